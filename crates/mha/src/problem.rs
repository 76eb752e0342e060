//! What every attention path knows of one call besides its tensors: its sizes
//! ([`Dims`]) and how its scores are made from `Q Kᵀ` ([`Scores`]). A leaf: the CPU tiles
//! (`crate::cpu`), the GPU kernels (`crate::gpu`) and the operations above them all read
//! it.

/// How the scores are made from `Q Kᵀ`: the scale and the soft cap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scores {
    pub(crate) scale: f64,
    pub(crate) softcap: Option<f64>,
}

/// The sizes of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    /// Key and value heads, a divisor of `heads`: query head `h` reads `h / (heads /
    /// kv_heads)`.
    pub(crate) kv_heads: usize,
    pub(crate) queries: usize,
    pub(crate) keys: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
}

impl Dims {
    /// The sizes of query `[B, H, Tq, Dk]`, key `[B, Hkv, Tk, Dk]` and value `[B, Hkv,
    /// Tk, Dv]`.
    pub(crate) fn of([query, key, value]: [[usize; 4]; 3]) -> Self {
        let [batch, heads, queries, d_k] = query;
        Self {
            batch,
            heads,
            kv_heads: key[1],
            queries,
            keys: key[2],
            d_k,
            d_v: value[3],
        }
    }

    /// Query heads per key/value head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// The multiply-adds of the forward pass with every key visible, `B·H·Tq·Tk·(Dk +
    /// Dv)` (saturating): what decides whether a call is worth splitting over threads.
    #[cfg(feature = "cpu-kernels")]
    pub(crate) fn multiply_adds(&self) -> usize {
        [
            self.batch,
            self.heads,
            self.queries,
            self.keys,
            self.d_k + self.d_v,
        ]
        .into_iter()
        .fold(1usize, usize::saturating_mul)
    }
}
