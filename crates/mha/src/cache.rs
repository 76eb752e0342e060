//! Decoding with a key/value cache: a prompt is run once (prefill), then tokens one at a
//! time, each attending to the keys and values the cache kept instead of recomputing the
//! prefix.
//!
//! A [`KvCache`] belongs to one self-attention layer. Its storage, `[B, Hkv, slots, Dh]`
//! for the keys and the same for the values (only the key/value heads under GQA), is
//! allocated once at the first call and written in place: a step writes its own keys and
//! values and reads the cached ones where they lie, with no concatenation of the whole
//! cache. Keys are stored as attention uses them (RoPE already applied at their
//! positions). With a window ([`KvCache::sliding`]) the storage is a ring of `W` slots
//! that keeps the last `W` positions (`W + k` of each with
//! [`with_rollback(k)`](KvCache::with_rollback)), for
//! sliding-window attention of any length; a step reads a ring of `W` as it lies where
//! the order of the keys does not matter, and in the order of their positions (the
//! window's `W - 1` cached keys and values copied once per step) where it does: a mask
//! over them, a bias by distance, the weights asked for.
//!
//! [`MultiHeadAttention::forward_cached`](crate::MultiHeadAttention::forward_cached)
//! decodes one layer; the blocks and stacks decode through their `forward`, given a cache
//! ([`BlockInput::cache`](crate::BlockInput::cache), one cache per layer in a
//! [`StackCache`]) and, for the encoder-decoder, the cross-attention's keys and values
//! computed once per source ([`MemoryKv`]). Prompts of different lengths decode together
//! padded on the left ([`BlockInput::left_padding`](crate::BlockInput::left_padding)).
//!
//! Beam search keeps and reorders its beams with [`KvCache::select_rows`] (or
//! [`StackCache::select_rows`], which selects a decoder's sources too), which also spreads
//! one prompt's cache over several continuations; speculative decoding forgets the
//! rejected draft tokens with [`KvCache::truncate`] (a sliding cache built
//! [`with_rollback`](KvCache::with_rollback) as far back as it checks drafts).
//!
//! Decode on a device without autodiff (`model.valid()`). Under autodiff Burn keeps the
//! graph of each call that no backward pass consumed, and a call's graph reaches back
//! through the cache to every earlier call's (the keys it reads came from them: its
//! gradient is the whole sequence's); each write then copies the storage, which the
//! graphs hold. Memory grows with every step: a stack of 4 blocks (d_model 256, batch 4,
//! a window of 64) on flex grew by about 2.5 MB a step with a cache, 0.5 MB without.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::error::CacheError;
use crate::mask::{AttentionMask, CausalAlignment};

/// The key/value cache of one self-attention layer (see the [module docs](self)).
///
/// Cloning a cache is cheap and safe: the clones share the storage until one writes,
/// which then copies it (to decode continuations apart; beams that decode as one batch
/// are reordered with [`select_rows`](Self::select_rows)).
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Positions of storage: the capacity, or the window and the slack.
    slots: usize,
    /// Positions a ring keeps beyond its window, for [`KvCache::truncate`] to go back to.
    slack: usize,
    /// A ring of the last `slots` positions rather than positions `0..slots`.
    ring: bool,
    /// Allocated at the first call, when the batch, heads and dtype are known.
    store: Option<Store>,
    /// Positions cached so far: the position of the next token.
    len: usize,
    /// The furthest length written since the last reset, `len` or more after a
    /// [`KvCache::truncate`]: a ring has written positions `..reach - slots` over.
    reach: usize,
    /// Every call reads all the slots (see [`KvCache::fixed_reads`]).
    fixed: bool,
}

/// A cache's storage: keys and values `[B, Hkv, slots, Dh]`.
#[derive(Clone, Debug)]
struct Store {
    keys: Tensor<4>,
    values: Tensor<4>,
}

/// What one attention call over the cache sees: its keys and values, and the rule by
/// position between the call's queries (the last of them) and those keys.
pub(crate) struct Seen {
    pub(crate) keys: Tensor<4>,
    pub(crate) values: Tensor<4>,
    pub(crate) mask: AttentionMask,
}

impl KvCache {
    /// A cache for positions `0..capacity` of each batch row; a call past them is a
    /// [`CacheError::Full`].
    ///
    /// # Panics
    /// If `capacity` is 0.
    pub fn new(capacity: usize) -> Self {
        assert!(
            capacity >= 1,
            "KvCache::new: capacity must be at least 1, got 0"
        );
        Self {
            slots: capacity,
            slack: 0,
            ring: false,
            store: None,
            len: 0,
            reach: 0,
            fixed: false,
        }
    }

    /// The same cache, each call attending to all `capacity` slots, those not yet written
    /// blocked by the causal rule (aligned at [`CausalAlignment::Offset`]), so that every
    /// call of one number of tokens has one shape, for kernels compiled by shape. The
    /// outputs are the same; each step does the work of a full cache. A sliding cache
    /// reads its ring as usual. The decoding kernels of the GPU backends take the number of
    /// keys at run time: on lavapipe, a cache read as it fills (a stack of 2 blocks,
    /// d_model 256, batch 2, 150 steps) had no step past 2x the median after its first.
    pub fn fixed_reads(mut self) -> Self {
        self.fixed = !self.ring;
        self
    }

    /// A cache for sliding-window attention: each position attends to at most the last
    /// `window` positions, itself included ([`AttentionMask::sliding_window`]), and the
    /// cache keeps exactly those, in a ring of `window` slots, for sequences of any length.
    ///
    /// # Panics
    /// If `window` is 0.
    pub fn sliding(window: usize) -> Self {
        assert!(
            window >= 1,
            "KvCache::sliding: window must be at least 1, got 0"
        );
        Self {
            ring: true,
            ..Self::new(window)
        }
    }

    /// The same sliding cache keeping `positions` positions more than its window, so that
    /// [`truncate`](Self::truncate) can go back that many (and one more) once its ring has
    /// wrapped: for speculative decoding, the most draft tokens a step checks. Its ring
    /// has `window + positions` slots, and a step reads the window's keys in the order
    /// of their positions (a ring of the window alone may be read as it lies). A cache
    /// by position can go back to any length: it is left as it is.
    ///
    /// # Panics
    /// If the cache holds positions (build it with its rollback before decoding), or if
    /// `window + positions` overflows a `usize`.
    pub fn with_rollback(mut self, positions: usize) -> Self {
        assert!(
            self.len == 0,
            "KvCache::with_rollback: the cache holds {} positions; give it its rollback \
             before the first call",
            self.len
        );
        if self.ring {
            let window = self.window_len();
            self.slots = window.checked_add(positions).unwrap_or_else(|| {
                panic!(
                    "KvCache::with_rollback: a window of {window} and {positions} positions \
                     of rollback are more slots than a usize counts"
                )
            });
            self.slack = positions;
            // Storage of another size, from an earlier sequence.
            self.store = None;
        }
        self
    }

    /// Positions cached so far: the position the next token will have.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The window of a sliding cache, which may keep more positions than it (`slack`).
    fn window_len(&self) -> usize {
        self.slots - self.slack
    }

    /// Positions it can hold, or `None` for a sliding cache (any number).
    pub fn capacity(&self) -> Option<usize> {
        (!self.ring).then_some(self.slots)
    }

    /// The window of a sliding cache.
    pub fn window(&self) -> Option<usize> {
        self.ring.then_some(self.window_len())
    }

    /// The keys a call of `tokens` new tokens attends to, in order: the cached positions
    /// it can see (all of them; with a window `W`, the last `W - 1` at most), then the new
    /// ones (with [`fixed_reads`](Self::fixed_reads): every slot). A mask given with the
    /// call covers these keys.
    pub fn keys_seen(&self, tokens: usize) -> usize {
        match (self.ring, self.fixed) {
            (true, _) => self.len.min(self.window_len() - 1) + tokens,
            (false, true) => self.slots,
            (false, false) => self.len + tokens,
        }
    }

    /// `mask`, given with a call of `tokens` new tokens, aligned as the cache aligns the
    /// call's queries among the keys it sees ([`keys_seen`](Self::keys_seen)): bottom-right,
    /// or with [`fixed_reads`](Self::fixed_reads) at the cached positions (the last keys are
    /// then unwritten slots). A mask aligned bottom-right, or not aligned, means the same
    /// for every cache; another alignment must put the queries where the cache does.
    ///
    /// # Panics
    /// If `mask` places keys by position from another key than the call's first query.
    pub(crate) fn align(&self, mask: AttentionMask, tokens: usize) -> AttentionMask {
        if !mask.by_position() {
            return mask;
        }
        let (own, alignment) = match self.fixed {
            true => (self.len, CausalAlignment::Offset(self.len as i64)),
            false => (
                self.keys_seen(tokens) - tokens,
                CausalAlignment::BottomRight,
            ),
        };
        let asked = match mask.rule().alignment.unwrap_or_default() {
            CausalAlignment::BottomRight => return mask.aligned(alignment),
            CausalAlignment::TopLeft => 0,
            CausalAlignment::Offset(offset) => offset,
        };
        assert!(
            asked == own as i64,
            "forward_cached: the mask is aligned {:?}, which puts the call's first query \
             at key {asked}, but it stands at key {own} of the {} keys the call sees: \
             align the mask CausalAlignment::BottomRight, or leave it unaligned",
            mask.rule().alignment.unwrap_or_default(),
            self.keys_seen(tokens),
        );
        mask.aligned(alignment)
    }

    /// The position of the first key a call of `tokens` new tokens sees
    /// ([`keys_seen`](Self::keys_seen)): 0, or for a sliding cache the first of the cached
    /// positions it still keeps.
    pub(crate) fn first_key_position(&self, tokens: usize) -> usize {
        self.len + tokens - self.keys_seen(tokens).min(self.len + tokens)
    }

    /// The storage's shape, `[B, Hkv, slots, Dh]`, once allocated.
    pub fn dims(&self) -> Option<[usize; 4]> {
        self.store.as_ref().map(|store| store.keys.dims())
    }

    /// Forgets the cached positions, keeping the storage for the next sequence (which may
    /// have another batch size, dtype or device: the storage is then allocated again).
    pub fn reset(&mut self) {
        self.len = 0;
        self.reach = 0;
    }

    /// Keeps the batch rows `rows` of what is cached, in that order: the new batch row `i`
    /// is the old row `rows[i]`. A row may be kept several times or not at all: beam
    /// search's reordering of its beams after each step, or one prompt's cache spread
    /// over several continuations (`[0, 0, 0, 0]`). The next calls bring `rows.len()`
    /// rows (their left padding, if any, reordered the same way). With nothing cached
    /// there is nothing to select.
    ///
    /// # Errors
    /// [`CacheError::Row`] for a row past the cached batch; the cache is unchanged.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<(), CacheError> {
        self.check_rows(rows)?;
        if self.len > 0
            && let Some(store) = self.store.take()
        {
            self.store = Some(Store {
                keys: select_rows(store.keys, rows),
                values: select_rows(store.values, rows),
            });
        }
        Ok(())
    }

    /// What [`select_rows`](Self::select_rows) refuses.
    fn check_rows(&self, rows: &[usize]) -> Result<(), CacheError> {
        match &self.store {
            Some(store) if self.len > 0 => rows_of(rows, store.keys.dims()[0]),
            _ => Ok(()),
        }
    }

    /// Keeps the first `len` positions and forgets the later ones, which the next call
    /// writes over: the rejected tokens of speculative decoding rolled back. Keeping
    /// `len` positions or more of a cache that holds fewer changes nothing.
    ///
    /// A sliding cache writes each position over the oldest of its ring: it can go back to
    /// any length until it has written more positions than its ring has slots; after that,
    /// to one position before the furthest it has written, or `k + 1` with
    /// [`with_rollback(k)`](Self::with_rollback), however far an earlier truncate took it
    /// (a window of `W` needs the `W - 1` positions before the next one).
    ///
    /// # Errors
    /// [`CacheError::Truncate`] for a sliding cache whose window would need overwritten
    /// positions; the cache is unchanged.
    pub fn truncate(&mut self, len: usize) -> Result<(), CacheError> {
        self.check_truncate(len)?;
        self.len = self.len.min(len);
        Ok(())
    }

    /// What [`truncate`](Self::truncate) refuses.
    fn check_truncate(&self, len: usize) -> Result<(), CacheError> {
        // A ring has written positions `..reach - slots` over; the window of the next
        // position after `len'` starts at `len' - (window - 1)`.
        let earliest = match self.ring && self.reach > self.slots {
            true => self.reach - self.slack - 1,
            false => 0,
        };
        match len < earliest {
            true => Err(CacheError::Truncate {
                len,
                cached: self.len,
                earliest,
            }),
            false => Ok(()),
        }
    }

    /// Caches `keys` and `values` `[B, Hkv, T, Dh]` of the next `T` positions and returns
    /// what their queries attend to. `ordered`: the caller needs the keys in the order of
    /// their positions (a mask over them, a bias by distance); otherwise a window's ring may
    /// be read as it lies.
    ///
    /// # Errors
    /// [`CacheError::Full`] past the capacity, [`CacheError::Mismatch`] when the shapes
    /// differ from the cached ones ([`CacheError::DType`] the dtypes,
    /// [`CacheError::Device`] the devices); the cache is unchanged.
    pub(crate) fn write(
        &mut self,
        keys: Tensor<4>,
        values: Tensor<4>,
        ordered: bool,
    ) -> Result<Seen, CacheError> {
        let tokens = keys.dims()[2];
        if tokens == 0 {
            // Nothing to write; no query to see anything (`crate::dispatch` gives queries
            // without keys or keys without queries their empty result).
            return Ok(Seen {
                keys,
                values,
                mask: AttentionMask::none(),
            });
        }
        let brought = [Brought::of(&keys), Brought::of(&values)];
        self.check_write(&brought)?;
        if let Some(store) = &self.store
            && (check_like(&store.keys, &brought[0]).is_err()
                || check_like(&store.values, &brought[1]).is_err())
        {
            // A new sequence of another shape (`check_write` lets it through): new storage.
            self.store = None;
        }
        let store = match self.store.take() {
            Some(store) => store,
            None => Store {
                keys: storage(&keys, self.slots),
                values: storage(&values, self.slots),
            },
        };
        let (store, seen) = match self.ring {
            false => self.write_positions(store, keys, values),
            true => self.write_ring(store, keys, values, ordered),
        };
        self.store = Some(store);
        self.len += tokens;
        self.reach = self.reach.max(self.len);
        Ok(seen)
    }

    /// What [`write`](Self::write) refuses, for the keys and values a call brings,
    /// before anything is written (a stack checks every layer's first).
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub(crate) fn check_write(&self, [keys, values]: &[Brought; 2]) -> Result<(), CacheError> {
        let tokens = keys.dims[2];
        if tokens == 0 {
            return Ok(());
        }
        if !self.ring && self.len + tokens > self.slots {
            return Err(CacheError::Full {
                capacity: self.slots,
                position: self.len,
                tokens,
            });
        }
        match &self.store {
            // A new sequence may take another shape.
            Some(store) if self.len > 0 => {
                check_like(&store.keys, keys).and(check_like(&store.values, values))
            }
            _ => Ok(()),
        }
    }

    /// Positions `len..len + T` of a cache by position: written where they belong, then
    /// positions `0..len + T` read as they lie.
    fn write_positions(&self, store: Store, keys: Tensor<4>, values: Tensor<4>) -> (Store, Seen) {
        let tokens = keys.dims()[2];
        let store = Store {
            keys: write_slots(store.keys, self.len, keys),
            values: write_slots(store.values, self.len, values),
        };
        if self.fixed {
            let alignment = CausalAlignment::Offset(self.len as i64);
            let seen = Seen {
                keys: store.keys.clone(),
                values: store.values.clone(),
                mask: AttentionMask::causal().aligned(alignment),
            };
            return (store, seen);
        }
        let seen = Seen {
            keys: crate::empty::narrow(store.keys.clone(), 2, 0, self.len + tokens),
            values: crate::empty::narrow(store.values.clone(), 2, 0, self.len + tokens),
            mask: bottom_right(AttentionMask::causal()),
        };
        (store, seen)
    }

    /// The next positions of a ring of `S` slots (position `p` in slot `p % S`; `S` is
    /// the window `W`, or more with a slack).
    fn write_ring(
        &self,
        store: Store,
        keys: Tensor<4>,
        values: Tensor<4>,
        ordered: bool,
    ) -> (Store, Seen) {
        let (slots, window, tokens) = (self.slots, self.window_len(), keys.dims()[2]);
        if tokens == 1 && !ordered && slots == window {
            // One token: it sees every slot in use after its own write (the last `W`
            // positions, itself included), in any order.
            let store = Store {
                keys: write_ring(store.keys, self.len, keys, window),
                values: write_ring(store.values, self.len, values, window),
            };
            let used = (self.len + 1).min(window);
            let seen = Seen {
                keys: store.keys.clone().narrow(2, 0, used),
                values: store.values.clone().narrow(2, 0, used),
                mask: AttentionMask::none(),
            };
            return (store, seen);
        }
        // The last `W - 1` cached positions in order, then the new ones; the window
        // decides what each new query sees. Then the ring keeps the last `S` of them.
        let prior = self.len.min(window - 1);
        let start = self.len - prior;
        let read = |store: &Tensor<4>, new: &Tensor<4>| {
            let mut parts = ring_read(store, start, prior, slots);
            parts.push(new.clone());
            Tensor::cat(parts, 2)
        };
        let seen = Seen {
            keys: read(&store.keys, &keys),
            values: read(&store.values, &values),
            mask: bottom_right(AttentionMask::sliding_window(window)),
        };
        let kept = tokens.min(slots);
        let first = self.len + tokens - kept;
        let store = Store {
            keys: write_ring(
                store.keys,
                first,
                keys.narrow(2, tokens - kept, kept),
                slots,
            ),
            values: write_ring(
                store.values,
                first,
                values.narrow(2, tokens - kept, kept),
                slots,
            ),
        };
        (store, seen)
    }
}

/// `mask` with the causal part and the window aligned bottom-right: the new queries are
/// the last positions of the keys they see.
fn bottom_right(mask: AttentionMask) -> AttentionMask {
    mask.aligned(CausalAlignment::BottomRight)
}

/// Storage `[B, Hkv, slots, Dh]` for tensors like `like` (`[B, Hkv, T, Dh]`), in its
/// dtype, on its device.
fn storage(like: &Tensor<4>, slots: usize) -> Tensor<4> {
    let [batch, heads, _, width] = like.dims();
    Tensor::<4>::zeros([batch, heads, slots, width], &like.device()).cast(like.dtype())
}

/// The keys or values a call brings to a cache, `[B, Hkv, T, Dh]`: enough to check them
/// before they are computed.
pub(crate) struct Brought {
    pub(crate) dims: [usize; 4],
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

impl Brought {
    /// What `t` is.
    pub(crate) fn of(t: &Tensor<4>) -> Self {
        Self {
            dims: t.dims(),
            dtype: t.dtype(),
            device: t.device(),
        }
    }
}

/// # Errors
/// [`CacheError::Device`] when `new` is on another device than `cached`,
/// [`CacheError::DType`] of another dtype, else [`CacheError::Mismatch`] naming the first
/// axis where `new` differs from `cached`.
fn check_like(cached: &Tensor<4>, new: &Brought) -> Result<(), CacheError> {
    if cached.device() != new.device {
        return Err(CacheError::Device {
            cached: format!("{:?}", cached.device()),
            got: format!("{:?}", new.device),
        });
    }
    if cached.dtype() != new.dtype {
        return Err(CacheError::DType {
            cached: cached.dtype(),
            got: new.dtype,
        });
    }
    let (cached, new) = (cached.dims(), new.dims);
    for (axis, what) in [(0, "batch"), (1, "key/value heads"), (3, "head width")] {
        if cached[axis] != new[axis] {
            return Err(CacheError::Mismatch {
                what,
                cached: cached[axis],
                got: new[axis],
            });
        }
    }
    Ok(())
}

/// # Errors
/// [`CacheError::Row`] for the first of `rows` past a batch of `batch`.
fn rows_of(rows: &[usize], batch: usize) -> Result<(), CacheError> {
    match rows.iter().position(|&row| row >= batch) {
        Some(at) => Err(CacheError::Row {
            at,
            row: rows[at],
            batch,
        }),
        None => Ok(()),
    }
}

/// Batch rows `rows` of `store` (`[B, Hkv, slots, Dh]`), in that order.
fn select_rows(store: Tensor<4>, rows: &[usize]) -> Tensor<4> {
    let [_, heads, slots, width] = store.dims();
    if rows.is_empty() || heads * slots * width == 0 {
        let (device, dtype) = (store.device(), store.dtype());
        return Tensor::zeros([rows.len(), heads, slots, width], (&device, dtype));
    }
    let index: Vec<i64> = rows.iter().map(|&row| row as i64).collect();
    let index = TensorData::new(index, [rows.len()]);
    let index = Tensor::<1, Int>::from_data(index, &store.device());
    store.select(0, index)
}

/// `store` with `rows` (`[B, Hkv, n, Dh]`) written over slots `at..at + n`, in place when
/// the storage is not shared.
fn write_slots(store: Tensor<4>, at: usize, rows: Tensor<4>) -> Tensor<4> {
    let [batch, heads, n, width] = rows.dims();
    if n == 0 {
        return store;
    }
    store.slice_assign([0..batch, 0..heads, at..at + n, 0..width], rows)
}

/// `store`, a ring of `slots` slots, with `rows` (`[B, Hkv, n <= slots, Dh]`) written at
/// positions `first..first + n`: one or two slot ranges.
fn write_ring(store: Tensor<4>, first: usize, rows: Tensor<4>, slots: usize) -> Tensor<4> {
    let n = rows.dims()[2];
    let slot = first % slots;
    let head = n.min(slots - slot);
    match head == n {
        true => write_slots(store, slot, rows),
        false => {
            let store = write_slots(store, slot, rows.clone().narrow(2, 0, head));
            write_slots(store, 0, rows.narrow(2, head, n - head))
        }
    }
}

/// Positions `start..start + n` of a ring of `slots` slots, in order (`n < slots`): no
/// part, one, or two where they wrap around.
fn ring_read(store: &Tensor<4>, start: usize, n: usize, slots: usize) -> Vec<Tensor<4>> {
    let slot = start % slots;
    let head = n.min(slots - slot);
    let parts = [(slot, head), (0, n - head)];
    parts
        .into_iter()
        .filter(|&(_, len)| len > 0)
        .map(|(at, len)| store.clone().narrow(2, at, len))
        .collect()
}

/// The cross-attention's keys and values of one source (the encoder's output), computed
/// once by [`MultiHeadAttention::memory_kv`](crate::MultiHeadAttention::memory_kv) and
/// read by every decoding step.
#[derive(Clone, Debug)]
pub struct MemoryKv {
    /// `[B, Hkv, Tk, Dh]`.
    pub(crate) keys: Tensor<4>,
    /// `[B, Hkv, Tk, Dh]`.
    pub(crate) values: Tensor<4>,
}

impl MemoryKv {
    /// The keys' shape `[B, Hkv, Tk, Dh]`.
    pub(crate) fn keys_dims(&self) -> [usize; 4] {
        self.keys.dims()
    }

    /// The source's length `Tk`.
    pub fn len(&self) -> usize {
        self.keys.dims()[2]
    }

    /// Whether the source is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the batch rows `rows`, in that order, as [`KvCache::select_rows`] does: the
    /// sources of the beams a beam search keeps.
    ///
    /// # Errors
    /// [`CacheError::Row`] for a row past the batch; the keys and values are unchanged.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<(), CacheError> {
        self.check_rows(rows)?;
        self.keys = select_rows(self.keys.clone(), rows);
        self.values = select_rows(self.values.clone(), rows);
        Ok(())
    }

    /// What [`select_rows`](Self::select_rows) refuses.
    fn check_rows(&self, rows: &[usize]) -> Result<(), CacheError> {
        rows_of(rows, self.keys.dims()[0])
    }
}

/// The caches of a stack's layers, one [`KvCache`] per layer (and for a
/// [`Decoder`](crate::Decoder), each layer's [`MemoryKv`]).
#[derive(Clone, Debug)]
pub struct StackCache {
    pub(crate) layers: Vec<KvCache>,
    pub(crate) memory: Vec<MemoryKv>,
}

impl StackCache {
    /// Caches for `layers` layers, each like `cache` (e.g. [`KvCache::new`] with the
    /// longest sequence to decode).
    pub fn new(layers: usize, cache: KvCache) -> Self {
        Self {
            layers: vec![cache; layers],
            memory: Vec::new(),
        }
    }

    /// Positions cached so far: the position the next token will have.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache of each layer.
    pub fn layers(&self) -> &[KvCache] {
        &self.layers
    }

    /// Forgets the cached positions (and a decoder's source), keeping the storage.
    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KvCache::reset);
        self.memory.clear();
    }

    /// Keeps the batch rows `rows`, in that order, in every layer's cache (and a
    /// decoder's source): see [`KvCache::select_rows`].
    ///
    /// # Errors
    /// [`CacheError::Row`] for a row past a layer's batch or a decoder source's; nothing is
    /// changed.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<(), CacheError> {
        for layer in &self.layers {
            layer.check_rows(rows)?;
        }
        for memory in &self.memory {
            memory.check_rows(rows)?;
        }
        for layer in &mut self.layers {
            layer.select_rows(rows)?;
        }
        for memory in &mut self.memory {
            memory.select_rows(rows)?;
        }
        Ok(())
    }

    /// Keeps the first `len` positions of every layer's cache: see
    /// [`KvCache::truncate`].
    ///
    /// # Errors
    /// [`CacheError::Truncate`] where a sliding cache cannot go back that far; nothing is
    /// changed.
    pub fn truncate(&mut self, len: usize) -> Result<(), CacheError> {
        for layer in &self.layers {
            layer.check_truncate(len)?;
        }
        for layer in &mut self.layers {
            layer.truncate(len)?;
        }
        Ok(())
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// `[1, 1, T, 1]` holding `values`.
    fn column(values: &[f32]) -> Tensor<4> {
        let data = TensorData::new(values.to_vec(), [1, 1, values.len(), 1]);
        Tensor::from_data(data, &Device::flex())
    }

    fn values(t: Tensor<4>) -> Vec<f32> {
        t.into_data().try_into_vec::<f32>().unwrap()
    }

    #[test]
    fn a_cache_by_position_sees_every_position_so_far() {
        let mut cache = KvCache::new(5);
        let seen = cache
            .write(column(&[1., 2.]), column(&[1., 2.]), false)
            .unwrap();
        assert_eq!(values(seen.keys), [1., 2.]);
        let seen = cache.write(column(&[3.]), column(&[3.]), false).unwrap();
        assert_eq!(values(seen.keys), [1., 2., 3.]);
        assert_eq!(cache.dims(), Some([1, 1, 5, 1]));
        let err = cache.write(column(&[4., 5., 6.]), column(&[4., 5., 6.]), false);
        assert_eq!(
            err.err(),
            Some(CacheError::Full {
                capacity: 5,
                position: 3,
                tokens: 3
            })
        );
        assert_eq!(cache.len(), 3, "a refused call leaves the cache as it was");
        let seen = cache
            .write(column(&[4., 5.]), column(&[4., 5.]), false)
            .unwrap();
        assert_eq!(values(seen.values), [1., 2., 3., 4., 5.]);
    }

    #[test]
    fn a_ring_keeps_the_last_positions_and_reads_them_in_order_when_asked() {
        let mut cache = KvCache::sliding(3);
        // A prompt longer than the window: every key it brings is seen, the last 3 kept.
        let seen = cache.write(column(&[0., 1., 2., 3.]), column(&[0., 1., 2., 3.]), false);
        assert_eq!(values(seen.unwrap().keys), [0., 1., 2., 3.]);
        assert_eq!(cache.keys_seen(1), 3);
        // Position 4 goes in slot 1; unordered, the ring is read as it lies.
        let seen = cache.write(column(&[4.]), column(&[4.]), false).unwrap();
        assert_eq!(values(seen.keys), [3., 4., 2.]);
        // Ordered: the last two cached positions, then the new one.
        let seen = cache.write(column(&[5.]), column(&[5.]), true).unwrap();
        assert_eq!(values(seen.keys), [3., 4., 5.]);
        // Two tokens across the ring's end.
        let seen = cache
            .write(column(&[6., 7.]), column(&[6., 7.]), false)
            .unwrap();
        assert_eq!(values(seen.keys), [4., 5., 6., 7.]);
        let seen = cache.write(column(&[8.]), column(&[8.]), true).unwrap();
        assert_eq!(values(seen.keys), [6., 7., 8.]);
        assert_eq!(cache.len(), 9);
    }

    #[test]
    fn other_shapes_are_refused_by_name() {
        let mut cache = KvCache::new(4);
        cache.write(column(&[1.]), column(&[1.]), false).unwrap();
        let wide = Tensor::<4>::zeros([1, 1, 1, 2], &Device::flex());
        let err = cache.write(wide.clone(), wide, false).err().unwrap();
        assert_eq!(
            err.to_string(),
            "KvCache: it holds head width 1, the call brings head width 2 (reset it to start another sequence)"
        );
    }
}
