//! The host side of every launch: a call's tensors as bindings, the tiles that fit the
//! device's shared memory, the grid (folded where `B · H` passes a dimension's limit),
//! the one launch argument every kernel reads, and the passes themselves.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::backward::{
    BiasSums, CHUNK, delta_kernel, dkv_kernel, dq_kernel, reduce_kernel, zeros_kernel,
};
pub(crate) use super::backward::{DkvTiles, DqTiles};
use super::decode::{DecodeTiles, combine_kernel, decode_kernel};
pub(crate) use super::forward::ForwardTiles;
use super::forward::forward_kernel;
use super::scores::{KEYS_LAST_FIRST, ProblemLaunch, QUERIES_LAST_FIRST};
use super::tile::{Cooperative, Emulated, Fragment, Registers};
use crate::mask::Band;
use crate::problem::Dims;

/// Launches a kernel over the tile product its fragment `frag` asks for ([`Cooperative`]
/// where it is one, or its stand-in [`Emulated`] where a test asks for it; else the
/// portable [`Registers`]): checked (an out-of-bounds index
/// clamped to the buffer) in debug builds, where the tests run, unchecked in release,
/// where it took 6% less device time per kernel on lavapipe (`docs/benchmarks.md`).
macro_rules! launch {
    ($frag:expr, $kernel:ident($($arg:expr),* $(,)?)) => {
        if $frag.is_some() && emulated() {
            launch!(@ Emulated, $kernel($($arg),*))
        } else if $frag.is_some() {
            launch!(@ Cooperative, $kernel($($arg),*))
        } else {
            launch!(@ Registers, $kernel($($arg),*))
        }
    };
    (@ $product:ident, $kernel:ident($($arg:expr),*)) => {
        if cfg!(debug_assertions) {
            $kernel::launch::<$product>($($arg),*)
        } else {
            // SAFETY: the kernels index within the tensors' shapes, and the tests
            // run them checked with every buffer followed by a guard, at the tiles' edges.
            unsafe { $kernel::launch_unchecked::<$product>($($arg),*) }
        }
    };
    // A kernel without a tile product.
    (plain $kernel:ident($($arg:expr),* $(,)?)) => {
        if cfg!(debug_assertions) {
            $kernel::launch($($arg),*)
        } else {
            // SAFETY: as above.
            unsafe { $kernel::launch_unchecked($($arg),*) }
        }
    };
}

/// The most storage buffers one launch binds: `dq_kernel`'s thirteen tensors (query, key,
/// value, bias, bias by distance, mask, sequences, output gradient, log-sum-exp, `D`,
/// `dQ`, the partial rows of the two bias gradients) and the buffer CubeCL passes the
/// sizes and scalars in. A device that binds fewer to a kernel (a browser's
/// WebGPU binds 8 per stage, of which CubeCL offers 7) takes the explicit path instead
/// (`dispatch`).
pub(crate) const MOST_BINDINGS: u32 = 14;

/// Shared memory the kernels use at most, whatever the device offers: what the smallest
/// devices that run them give (Mesa's lavapipe: 32 KiB).
const SHARED_BUDGET: usize = 32 * 1024;

/// Shared memory the kernels on cooperative matrices use at most: what every device
/// with them offers (NVIDIA's Vulkan drivers: 48 KiB).
const COOPERATIVE_BUDGET: usize = 48 * 1024;

/// Shared memory the portable product's tiles may take, where the device has it, when
/// a measurement asks for them by name ([`TILES_VAR`]): what NVIDIA's Vulkan drivers
/// give a workgroup. Larger tiles than [`SHARED_BUDGET`] allows (128,64,32 in f32,
/// 128,64,64 in f16 at head dim 64), to be measured against the default ones before any
/// device takes them unasked.
const ASKED_BUDGET: usize = 48 * 1024;

/// The cooperative-matrix fragment a device multiplies inputs of `elem` in with f32
/// sums, read from what it reports (`props.features.matmul.cmma`): the largest of its
/// shapes with `A` and `B` in `elem` and `C` in f32, where `elem` is f16 or bf16 and the
/// device runs subgroups of one size (a fragment belongs to one). The kernels take it
/// where their tiles are whole fragments ([`tiles`]).
///
/// # Errors
/// Why there is none: the dtype, the subgroup sizes, or the shapes the device reports.
pub(crate) fn fragment(props: &DeviceProperties, elem: ElemType) -> Result<Fragment, String> {
    use cubecl::ir::FloatKind;
    if !matches!(elem, ElemType::Float(FloatKind::F16 | FloatKind::BF16)) {
        return Err(format!(
            "cooperative matrices take f16 or bf16, not {elem:?}"
        ));
    }
    let hardware = &props.hardware;
    if hardware.plane_size_min != hardware.plane_size_max || hardware.plane_size_min == 0 {
        return Err(format!(
            "the device's subgroups are of {} to {} units",
            hardware.plane_size_min, hardware.plane_size_max
        ));
    }
    let f32_sums = ElemType::Float(FloatKind::F32);
    let cmma = &props.features.matmul.cmma;
    cmma.iter()
        .filter(|c| c.a_type == elem && c.b_type == elem && c.cd_type == f32_sums)
        .filter(|c| {
            [c.m, c.n, c.k]
                .iter()
                .all(|&s| s.is_power_of_two() && s <= 16)
        })
        .max_by_key(|c| (c.m * c.n * c.k, c.n, c.m))
        .map(|c| Fragment {
            m: c.m as usize,
            n: c.n as usize,
            k: c.k as usize,
            plane: hardware.plane_size_max as usize,
        })
        .ok_or_else(|| {
            format!(
                "the device reports no cooperative matrix of {elem:?} inputs and f32 sums \
                 of at most 16 x 16 x 16 (it reports {cmma:?})"
            )
        })
}

/// How the scores are made from `Q Kᵀ`, and which keys each query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scoring {
    /// Multiplies `Q Kᵀ`.
    pub(crate) scale: f32,
    /// `cap · tanh(s / cap)` on the scaled scores, before the bias.
    pub(crate) softcap: Option<f32>,
    /// The keys of each query.
    pub(crate) band: Band,
}

/// The tensors of one call, as bindings: `[query, key, value]` (`[B, H, Tq, Dk]`, `[B, Hkv,
/// Tk, Dk]`, `[B, Hkv, Tk, Dv]`), an additive `bias` and a boolean `mask` (u8 or u32,
/// nonzero = blocked; `mask_elem` says which), each of rank 4 and broadcastable to `[B,
/// H, Tq, Tk]`; a bias by distance `pd` (`[1, 1, H, Tq + Tk - 1]`) and packed sequences'
/// bounds `seq` (i32 `[B, 1, T, 2]`, see `Visibility::sequences`).
pub(crate) struct Inputs {
    /// The float tensors' element type (f32, f16 or bf16): the kernels compute in f32 and
    /// read and write this one.
    pub(crate) elem: ElemType,
    /// Its size in bytes.
    pub(crate) size: usize,
    /// A bias at or below this blocks its score (the dtype's sentinel, see
    /// `crate::mask::blocked_score`).
    pub(crate) blocked: f32,
    pub(crate) qkv: [TensorBinding; 3],
    pub(crate) bias: Option<TensorBinding>,
    pub(crate) pd: Option<TensorBinding>,
    pub(crate) mask: Option<TensorBinding>,
    /// The mask's element type (u32 where there is none).
    pub(crate) mask_elem: ElemType,
    pub(crate) seq: Option<TensorBinding>,
}

impl Inputs {
    /// The sizes of the call.
    ///
    /// # Panics
    /// If the shapes disagree or a size passes `i32`.
    pub(crate) fn dims(&self) -> Dims {
        let [q, k, v] = &self.qkv;
        let dims = Dims::of([dims(q), dims(k), dims(v)]);
        assert!(
            dims.kv_heads > 0 && dims.heads.is_multiple_of(dims.kv_heads),
            "gpu attention: query {:?}, key {:?}, value {:?}",
            q.shape,
            k.shape,
            v.shape
        );
        within(
            dims.batch
                * dims.heads.max(dims.kv_heads)
                * (dims.queries + dims.keys + 1)
                * (dims.d_k + dims.d_v).max(1),
        );
        dims
    }

    /// How many elements of the query, key, value (and `also`, the output's gradient) the
    /// kernels read at once: 4 where every row of each is whole quads of elements one
    /// apart (head dims and the outer strides multiples of 4), else 1.
    pub(crate) fn width(&self, also: Option<&TensorBinding>) -> usize {
        let quads = |t: &TensorBinding| {
            let [_, _, _, d] = dims(t);
            d.is_multiple_of(4)
                && t.strides[3] == 1
                && (0..3).all(|a| t.strides[a].is_multiple_of(4))
        };
        match self.qkv.iter().chain(also).all(quads) {
            true => 4,
            false => 1,
        }
    }

    /// The launch argument every kernel reads: the tensors (an absent one binds nothing)
    /// and the scalars of `scoring`.
    fn problem<F: Float, M: Int, N: Size>(
        &self,
        dims: &Dims,
        scoring: Scoring,
    ) -> ProblemLaunch<F, M, N> {
        let [offset, before, after] = band(dims, scoring.band);
        let arg = |t: &TensorBinding| t.clone().into_tensor_arg();
        ProblemLaunch::new(
            arg(&self.qkv[0]),
            arg(&self.qkv[1]),
            arg(&self.qkv[2]),
            optional(&self.bias),
            optional(&self.pd),
            optional(&self.mask),
            optional(&self.seq),
            offset,
            before,
            after,
            dims.group() as u32,
            scoring.scale,
            scoring.softcap.unwrap_or(0.0),
            self.blocked,
            order(dims, scoring.band),
        )
    }
}

/// `t` as an optional kernel argument, read as broadcast along its axes of size 1; an
/// absent tensor binds nothing.
fn optional<T: CubePrimitive>(t: &Option<TensorBinding>) -> ComptimeOptionArgs<OwnedTensor<T>> {
    match t {
        Some(t) => ComptimeOptionArgs::Some(broadcast(t.clone()).into_tensor_arg()),
        None => ComptimeOptionArgs::None,
    }
}

/// The run-time arguments of `band` (`offset`, `before`, `after`), giving every query and
/// key of the call the keys and queries `band` gives them. The kernels read the keys of
/// query `i` as `i + offset - before ..= i + offset + after`, so only the band's first and
/// last distances from the query, `offset - before` and `offset + after`, matter: each is
/// cut to the call's size (a distance past every key of every query, an open side, is
/// one past the sizes), and passed with offset 0. The bias by distance is made with the
/// offset itself (`ops`).
fn band(dims: &Dims, band: Band) -> [i32; 3] {
    let far = within(dims.queries + dims.keys + 1);
    let cut = |distance: i64| distance.clamp(-i64::from(far), i64::from(far)) as i32;
    let first = band
        .before
        .map_or(-i64::from(far), |n| band.offset.saturating_sub(n as i64));
    let last = band
        .after
        .map_or(i64::from(far), |n| band.offset.saturating_add(n as i64));
    [0, -cut(first), cut(last)]
}

/// Which blocks come first: the longest rows. A band open before the own position and
/// closed after it (causal) gives later queries more keys, and earlier keys more queries.
fn order(dims: &Dims, band: Band) -> u32 {
    let _ = dims;
    match (band.before, band.after) {
        (None, Some(_)) => QUERIES_LAST_FIRST,
        (Some(_), None) => KEYS_LAST_FIRST,
        _ => 0,
    }
}

/// The tiles the kernels may take, as (units, queries, keys per tile), in order of
/// preference: the larger, the fewer shared-memory reads per multiply-add.
pub(crate) const CANDIDATES: [(usize, usize, usize); 6] = [
    (128, 64, 64),
    (128, 64, 32),
    (64, 32, 32),
    (32, 16, 32),
    (32, 32, 16),
    (16, 16, 16),
];

/// Whether the smallest of [`CANDIDATES`] fits `shared` bytes at head dims `d_k` and `d_v`
/// in elements of `size` bytes: the forward's tiles, and with `backward` the gradients'
/// too ([`choose`] takes it where no larger one fits).
pub(crate) fn smallest_fit(
    [d_k, d_v]: [usize; 2],
    size: usize,
    shared: usize,
    backward: bool,
) -> bool {
    let (u, q, k) = CANDIDATES[CANDIDATES.len() - 1];
    let forward = ForwardTiles::new(u, q, k, d_k, d_v).shared_bytes(size) <= shared;
    let dq = || DqTiles::new(u, q, k, d_k, d_v).shared_bytes(size) <= shared;
    let dkv = || DkvTiles::new(u, q, k, d_k, d_v).shared_bytes(size) <= shared;
    forward && (!backward || (dq() && dkv()))
}

/// The tiles of the three kernels for a call of `dims` in elements of `size` bytes: for
/// each, the first of the candidates (units, queries, keys per tile; [`CANDIDATES`], or
/// the one [`TILES_VAR`] asks for first) whose products are whole fragments of `frag`
/// (and whole planes of units) and whose shared memory fits the device's and
/// [`COOPERATIVE_BUDGET`]; where none is (or `frag` is [`Fragment::NONE`]), the first
/// that fits [`SHARED_BUDGET`] with the portable product ([`ASKED_BUDGET`] for the one
/// [`TILES_VAR`] asks for). Where [`TILES_VAR`] is set, the tiles taken are written to
/// the standard error, once for each call's sizes.
pub(crate) fn tiles(
    dims: &Dims,
    size: usize,
    shared: usize,
    softcap: bool,
    frag: Fragment,
) -> (ForwardTiles, DqTiles, DkvTiles) {
    let asked = tiles_asked();
    let first = |kernel| asked.and_then(|(_, a)| a.first(kernel, size));
    let mut forward: ForwardTiles = choose(dims, size, shared, frag, first(Kernel::Forward));
    let mut dq: DqTiles = choose(dims, size, shared, frag, first(Kernel::Dq));
    let mut dkv: DkvTiles = choose(dims, size, shared, frag, first(Kernel::Dkv));
    forward.softcap = softcap;
    dq.softcap = softcap;
    dkv.softcap = softcap;
    if let Some((raw, _)) = asked {
        say_taken(dims, size, raw, [forward.taken(), dq.taken(), dkv.taken()]);
    }
    (forward, dq, dkv)
}

/// What [`choose`] reads of one kernel's tiles.
trait KernelTiles: Sized {
    fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self;
    fn shared_bytes(&self, size: usize) -> usize;
    fn cooperative(self, frag: Fragment) -> Option<Self>;
    /// Units, queries and keys per tile, and whether on cooperative matrices.
    fn taken(&self) -> Taken;
}

/// A kernel's tiles as [`say_taken`] reports them: units, queries, keys, cooperative.
type Taken = (usize, usize, usize, bool);

/// Writes the tiles each kernel took to the standard error, where [`TILES_VAR`] is set
/// (to `asked`): once for each call's head dims, element size and tiles.
fn say_taken(dims: &Dims, size: usize, asked: &str, taken: [Taken; 3]) {
    type Key = (usize, usize, usize, [Taken; 3]);
    static SAID: std::sync::Mutex<Vec<Key>> = std::sync::Mutex::new(Vec::new());
    let key = (dims.d_k, dims.d_v, size, taken);
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if said.contains(&key) {
        return;
    }
    said.push(key);
    let [f, q, kv] = taken.map(|(u, bq, bk, cooperative)| match cooperative {
        true => format!("{u},{bq},{bk} cooperative"),
        false => format!("{u},{bq},{bk} portable"),
    });
    eprintln!(
        "{TILES_VAR}={asked}: tiles taken (units, queries, keys) at head dims {}/{} in \
         {size}-byte inputs: forward {f}, dQ {q}, dK/dV {kv}",
        dims.d_k, dims.d_v
    );
}

macro_rules! kernel_tiles {
    ($($tiles:ident),*) => {$(
        impl KernelTiles for $tiles {
            fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
                $tiles::new(units, bq, bk, d_k, d_v)
            }
            fn shared_bytes(&self, size: usize) -> usize {
                $tiles::shared_bytes(self, size)
            }
            fn cooperative(self, frag: Fragment) -> Option<Self> {
                $tiles::cooperative(self, frag)
            }
            fn taken(&self) -> Taken {
                (self.units, self.bq, self.bk, self.frag.is_some())
            }
        }
    )*};
}
kernel_tiles!(ForwardTiles, DqTiles, DkvTiles);

/// One kernel's tiles as [`tiles`] says, with `asked` (one of [`CANDIDATES`]) first where
/// [`TILES_VAR`] asks for it for this kernel (a test's forced tiles before all, in
/// fragments where they are whole ones).
fn choose<T: KernelTiles + Copy>(
    dims: &Dims,
    size: usize,
    shared: usize,
    frag: Fragment,
    asked: Option<(usize, usize, usize)>,
) -> T {
    let make = |(u, q, k): (usize, usize, usize)| T::new(u, q, k, dims.d_k, dims.d_v);
    #[cfg(test)]
    if let Some(forced) = super::tests::FORCE_TILES.get() {
        let t = make(forced);
        return t.cooperative(frag).unwrap_or(t);
    }
    let order = preference(asked);
    let budget = shared.min(COOPERATIVE_BUDGET);
    let cooperative = order
        .into_iter()
        .filter_map(|c| make(c).cooperative(frag))
        .find(|t| t.shared_bytes(size) <= budget);
    let budget = |c| match asked == Some(c) {
        true => shared.min(ASKED_BUDGET),
        false => shared.min(SHARED_BUDGET),
    };
    cooperative.unwrap_or_else(|| {
        order
            .into_iter()
            .find(|&c| make(c).shared_bytes(size) <= budget(c))
            .map_or_else(|| make(CANDIDATES[CANDIDATES.len() - 1]), make)
    })
}

/// The environment variable that puts one of [`CANDIDATES`] first in the kernels' order
/// of preference: to measure tiles against each other on a device
/// (`scripts/gpu_table.sh --tiles`), and to run on the tiles such a measurement found
/// fastest for each kernel. `units,queries,keys` (`128,64,32`) for every kernel, or
/// entries `KERNEL@DTYPE=units,queries,keys` separated by `;`
/// (`forward@f16=128,64,64;dkv=64,32,32`): `KERNEL` `forward`, `dq` or `dkv` (or `all`),
/// `DTYPE` `f32`, or `f16` for any 2-byte float (`bf16` says the same); the kernel may be
/// left out (`@f16=...`), the dtype with its `@` (`dq=...`), both with the `=`, and the
/// most specific entry that applies wins (kernel and dtype, then kernel, then dtype), the
/// later of two alike. A kernel whose products or shared memory the tiles do not fit
/// takes the next candidate that fits, as without it. Unset or `auto`: the order of
/// [`CANDIDATES`].
pub(crate) const TILES_VAR: &str = "MHA_GPU_TILES";

/// Tiles as (units, queries, keys per tile): one of [`CANDIDATES`].
type Candidate = (usize, usize, usize);

/// A kernel [`TILES_VAR`] may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Forward,
    Dq,
    Dkv,
}

impl Kernel {
    const ALL: [Kernel; 3] = [Kernel::Forward, Kernel::Dq, Kernel::Dkv];

    /// Its name in [`TILES_VAR`].
    fn name(self) -> &'static str {
        match self {
            Kernel::Forward => "forward",
            Kernel::Dq => "dq",
            Kernel::Dkv => "dkv",
        }
    }
}

/// What [`TILES_VAR`] asks for: tiles, each for one kernel or all (`None`), on inputs of
/// one width in bytes or all (`None`), in the order written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Asked(Vec<(Option<Kernel>, Option<usize>, Candidate)>);

impl Asked {
    /// The tiles asked first for `kernel` on inputs of `size` bytes: the most specific
    /// entry that applies (kernel and width, then kernel, then width), the later of two
    /// alike.
    fn first(&self, kernel: Kernel, size: usize) -> Option<Candidate> {
        self.0
            .iter()
            .filter(|(k, s, _)| k.is_none_or(|k| k == kernel) && s.is_none_or(|s| s == size))
            // `max_by_key` keeps the last of equals.
            .max_by_key(|(k, s, _)| (k.is_some(), s.is_some()))
            .map(|&(_, _, tiles)| tiles)
    }
}

/// The value [`TILES_VAR`] holds and what it asks for, unless it is unset or `auto`.
///
/// # Panics
/// On a value that is not `auto`, one of [`CANDIDATES`] or entries of them as
/// [`TILES_VAR`] says, naming it and them.
fn tiles_asked() -> Option<&'static (String, Asked)> {
    static ASKED: std::sync::OnceLock<Option<(String, Asked)>> = std::sync::OnceLock::new();
    ASKED
        .get_or_init(|| match std::env::var(TILES_VAR) {
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(v)) => panic!("{TILES_VAR}={v:?}: not UTF-8"),
            Ok(v) => {
                let asked = parse_tiles(&v).unwrap_or_else(|| {
                    panic!(
                        "{TILES_VAR}={v:?}: want `auto`, one of {} (units, queries, keys), \
                         or entries `KERNEL@DTYPE=units,queries,keys` separated by `;` \
                         (KERNEL `forward`, `dq`, `dkv` or `all`; DTYPE `f32` or `f16`, \
                         which stands for bf16 too, as `bf16` does; either may be left \
                         out)",
                        CANDIDATES
                            .map(|(u, q, k)| format!("`{u},{q},{k}`"))
                            .join(", ")
                    )
                });
                (!asked.0.is_empty()).then_some((v, asked))
            }
        })
        .as_ref()
}

/// What a value of [`TILES_VAR`] asks for (nothing for `auto` or nothing), or `None`
/// where it is not one it takes.
fn parse_tiles(v: &str) -> Option<Asked> {
    let v = v.trim();
    if v.is_empty() || v == "auto" {
        return Some(Asked::default());
    }
    v.split(';')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(parse_entry)
        .collect::<Option<Vec<_>>>()
        .map(Asked)
}

/// One entry of [`TILES_VAR`]: `[KERNEL][@DTYPE]=U,Q,K` or `U,Q,K`.
fn parse_entry(entry: &str) -> Option<(Option<Kernel>, Option<usize>, Candidate)> {
    let (scope, tiles) = entry.split_once('=').unwrap_or(("", entry));
    let (kernel, dtype) = match scope.split_once('@') {
        Some((kernel, dtype)) => (kernel.trim(), Some(dtype.trim())),
        None => (scope.trim(), None),
    };
    let kernel = match kernel {
        "" | "all" => None,
        name => Some(*Kernel::ALL.iter().find(|k| k.name() == name)?),
    };
    let size = match dtype {
        None => None,
        Some("f32") => Some(4),
        Some("f16" | "bf16") => Some(2),
        Some(_) => return None,
    };
    let parts: Vec<usize> = tiles
        .split(',')
        .map(|p| p.trim().parse().ok())
        .collect::<Option<_>>()?;
    let &[u, q, k] = parts.as_slice() else {
        return None;
    };
    CANDIDATES
        .contains(&(u, q, k))
        .then_some((kernel, size, (u, q, k)))
}

/// [`CANDIDATES`] with `first` (one of them) moved to the front.
fn preference(first: Option<(usize, usize, usize)>) -> [(usize, usize, usize); CANDIDATES.len()] {
    let mut order = CANDIDATES;
    if let Some(at) = first.and_then(|f| order.iter().position(|&c| c == f)) {
        order[..=at].rotate_right(1);
    }
    order
}

/// The environment variable that chooses the tile product: `portable` keeps the kernels
/// off cooperative matrices where the device has them (to compare, or to step around a
/// driver's fault); unset or `auto`, they take them where the device has them.
pub(crate) const TILE_PRODUCT_VAR: &str = "MHA_GPU_TILE_PRODUCT";

/// Reads [`TILE_PRODUCT_VAR`], [`TILES_VAR`] and [`DECODE_VAR`] (once in a process).
///
/// # Panics
/// On a value one refuses, naming it.
pub(crate) fn check_settings() {
    portable_asked();
    tiles_asked();
    tiles_only();
}

/// Whether [`TILE_PRODUCT_VAR`] asks for the portable product.
///
/// # Panics
/// On a value other than `auto` and `portable`, naming it.
fn portable_asked() -> bool {
    static PORTABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PORTABLE.get_or_init(|| switched(TILE_PRODUCT_VAR, "portable"))
}

/// Whether the environment variable `var` is set to `other` (unset, empty or `auto`:
/// not).
///
/// # Panics
/// On any other value, naming it.
fn switched(var: &str, other: &str) -> bool {
    match std::env::var(var) {
        Err(std::env::VarError::NotPresent) => false,
        Err(std::env::VarError::NotUnicode(v)) => panic!("{var}={v:?}: not UTF-8"),
        Ok(v) if v == "auto" || v.is_empty() => false,
        Ok(v) if v == other => true,
        Ok(v) => panic!("{var}={v:?}: want `auto` or `{other}`"),
    }
}

/// A device without a client, as the kernels' compiler and the tile choice read it:
/// subgroups of `subgroup` units, 48 KiB of shared memory, and, with `cooperative`
/// (`[m, n, k]`), cooperative matrices of that shape with f16 and bf16 inputs and f32
/// sums.
#[cfg(any(test, feature = "vulkan"))]
pub(crate) fn offline_device(subgroup: u32, cooperative: Option<[u32; 3]>) -> DeviceProperties {
    use cubecl::features::{Features, MmaConfig};
    use cubecl::ir::{DeviceIdentity, FloatKind, HardwareProperties, MemoryDeviceProperties};
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: subgroup,
        plane_size_max: subgroup,
        max_bindings: 31,
        max_shared_memory_size: 48 * 1024,
        max_cube_count: (65_535, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: 4,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut features = Features::default();
    if let Some([m, n, k]) = cooperative {
        for half in [FloatKind::F16, FloatKind::BF16] {
            features.matmul.cmma.insert(MmaConfig {
                a_type: ElemType::Float(half),
                b_type: ElemType::Float(half),
                cd_type: ElemType::Float(FloatKind::F32),
                m,
                n,
                k,
            });
        }
    }
    DeviceProperties::new(
        features,
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        cubecl::profile::TimingMethod::System,
        DeviceIdentity {
            name: "offline".into(),
            fingerprint: "offline".into(),
            physical: None,
        },
    )
}

/// Whether this thread's kernels take [`Emulated`] for their fragments (a test's).
fn emulated() -> bool {
    #[cfg(test)]
    return super::tests::EMULATE.get().is_some();
    #[cfg(not(test))]
    false
}

/// The fragment the kernels over `elem` inputs take on `client`'s device
/// ([`fragment`]), or [`Fragment::NONE`] (none there, or [`TILE_PRODUCT_VAR`] says
/// `portable`).
pub(crate) fn cooperative(client: &Client, elem: ElemType) -> Fragment {
    #[cfg(test)]
    if super::tests::PORTABLE.get() {
        return Fragment::NONE;
    }
    #[cfg(test)]
    if let Some(frag) = super::tests::EMULATE.get() {
        return frag;
    }
    if portable_asked() {
        return Fragment::NONE;
    }
    fragment(client.properties(), elem).unwrap_or(Fragment::NONE)
}

/// The dtype the kernels hold the weights `P` and `dS` in shared memory in: the
/// inputs' for products on cooperative matrices (which multiply that dtype), else f32.
fn weights(frag: Fragment, elem: ElemType) -> ElemType {
    match frag.is_some() {
        true => elem,
        false => ElemType::Float(cubecl::ir::FloatKind::F32),
    }
}

/// A grid of `cubes` cubes along `x`, folded into `y` past the device's limit on `x`
/// (the kernels number their cubes along `x`, then `y`).
fn grid(client: &Client, cubes: usize) -> CubeCount {
    let (max_x, max_y, _) = client.properties().hardware.max_cube_count;
    let x = cubes.clamp(1, max_x as usize);
    let y = cubes.div_ceil(x).max(1);
    assert!(
        y <= max_y as usize,
        "gpu attention: {cubes} cubes pass the device's grid of {max_x} x {max_y}"
    );
    CubeCount::Static(x as u32, y as u32, 1)
}

/// The output `[B, H, Tq, Dv]` (in the inputs' dtype, laid out `[B, Tq, H, Dv]`: the
/// heads of a `[B, Tq, H·Dv]` tensor) and the log-sum-exp `[B, H, Tq]` (f32, contiguous)
/// of attention over `inputs` under `scoring`; query head `h` reads key/value head
/// `h / (H / Hkv)`.
///
/// # Panics
/// If the shapes disagree or the sizes pass `i32`.
pub(crate) fn forward(client: &Client, inputs: &Inputs, scoring: Scoring) -> (Handle, Handle) {
    let n = inputs.dims();
    let shared = client.properties().hardware.max_shared_memory_size;
    if let Some(t) = decoding(&n, scoring, shared) {
        return decode(client, inputs, &n, scoring, t);
    }
    let (t, _, _) = tiles(
        &n,
        inputs.size,
        shared,
        scoring.softcap.is_some(),
        cooperative(client, inputs.elem),
    );
    let out_shape = [n.batch, n.heads, n.queries, n.d_v];
    let lse_shape = [n.batch, n.heads, n.queries, 1];
    let out = alloc(client, out_shape, inputs.size);
    let lse = alloc(client, lse_shape, 4);
    let cubes = n.queries.div_ceil(t.bq) * n.batch * n.heads;
    launch!(
        t.frag,
        forward_kernel(
            client,
            grid(client, cubes),
            CubeDim::new_1d(t.units as u32),
            inputs.width(None),
            inputs.problem(&n, scoring),
            heads_inside(out_shape, &out),
            contiguous(lse_shape, &lse),
            t,
            [inputs.elem, inputs.mask_elem, weights(t.frag, inputs.elem)],
        )
    );
    (out, lse)
}

/// Queries at or below which a call takes the decoding kernels ([`decode`]), which read
/// the keys and values once for each cube of up to [`DECODE_ROWS`] query rows, where the
/// tiled forward computes every score of its block of 16 to 64 rows: on lavapipe (8
/// heads of 64, 2048 keys) 4x as fast at one query, 2x at eight, and no faster at
/// sixteen (`docs/benchmarks.md`).
pub(crate) const DECODE_QUERIES: usize = 8;

/// Units of a decoding cube, and keys of its split (each unit scores four).
const DECODE_UNITS: usize = 64;
const DECODE_KEYS: usize = 256;
/// Query rows of a decoding cube at most (of one key/value head: the query heads of a
/// GQA group, and a call's queries), each key and value read once for all of them.
const DECODE_ROWS: usize = 8;

/// The environment variable that keeps the forward on the tiled kernel whatever the
/// number of queries: `tiles` (to compare, or to step around a driver's fault); unset
/// or `auto`, a call of at most [`DECODE_QUERIES`] queries takes the decoding kernels.
pub(crate) const DECODE_VAR: &str = "MHA_GPU_DECODE";

/// Whether [`DECODE_VAR`] asks for the tiled forward only.
///
/// # Panics
/// On a value other than `auto` and `tiles`, naming it.
fn tiles_only() -> bool {
    #[cfg(test)]
    if super::tests::TILED.get() {
        return true;
    }
    static TILES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TILES.get_or_init(|| switched(DECODE_VAR, "tiles"))
}

/// The decoding kernel's tiles for a call of `dims`, where it takes them: at most
/// [`DECODE_QUERIES`] queries, the cube's shared memory within the device's `shared`
/// bytes and [`SHARED_BUDGET`], and [`DECODE_VAR`] not set to `tiles`.
pub(crate) fn decoding(dims: &Dims, scoring: Scoring, shared: usize) -> Option<DecodeTiles> {
    let t = decode_tiles(dims, scoring);
    let fits = t.shared_bytes() <= shared.min(SHARED_BUDGET);
    (dims.queries <= DECODE_QUERIES && fits && !tiles_only()).then_some(t)
}

/// The decoding kernel's tiles for a call of `dims` under `scoring`, whichever forward
/// the call takes: the `group · Tq` rows that read a key/value head in as few cubes of
/// at most [`DECODE_ROWS`] rows as [`SHARED_BUDGET`] allows (one row a cube at least),
/// the same number of rows in each.
pub(crate) fn decode_tiles(dims: &Dims, scoring: Scoring) -> DecodeTiles {
    let rows = (dims.group() * dims.queries).max(1);
    let tiles = |chunks: usize| {
        DecodeTiles::new(
            [DECODE_UNITS, rows.div_ceil(chunks), DECODE_KEYS],
            [dims.d_k, dims.d_v],
            scoring.softcap.is_some(),
            dims.keys > DECODE_KEYS,
        )
    };
    (rows.div_ceil(DECODE_ROWS)..=rows)
        .map(tiles)
        .find(|t| t.shared_bytes() <= SHARED_BUDGET)
        .unwrap_or_else(|| tiles(rows))
}

/// [`forward`] on the decoding kernels (`super::decode`): one cube per split of
/// [`DECODE_KEYS`] keys and chunk of the query rows that read one key/value head
/// ([`decode_tiles`]), then, with more than one split, one unit per element of the
/// output to weigh the splits.
fn decode(
    client: &Client,
    inputs: &Inputs,
    n: &Dims,
    scoring: Scoring,
    t: DecodeTiles,
) -> (Handle, Handle) {
    let splits = n.keys.div_ceil(t.keys).max(1);
    let out_shape = [n.batch, n.heads, n.queries, n.d_v];
    let lse_shape = [n.batch, n.heads, n.queries, 1];
    let out = alloc(client, out_shape, inputs.size);
    let lse = alloc(client, lse_shape, 4);
    let rows = n.batch * n.heads * n.queries;
    let chunks = (n.group() * n.queries).div_ceil(t.rows);
    let f32_elem = ElemType::Float(cubecl::ir::FloatKind::F32);
    let split = |out: TensorArg, lse: TensorArg, w: ElemType| {
        launch!(plain decode_kernel(
            client,
            grid(client, n.batch * n.kv_heads * chunks * splits),
            CubeDim::new_1d(t.units as u32),
            inputs.width(None),
            inputs.problem(n, scoring),
            out,
            lse,
            t,
            [inputs.elem, inputs.mask_elem, w],
        ))
    };
    if !t.split {
        split(
            heads_inside(out_shape, &out),
            contiguous(lse_shape, &lse),
            inputs.elem,
        );
        return (out, lse);
    }
    let part_shape = [splits * n.batch, n.heads, n.queries, n.d_v];
    let part_lse_shape = [splits * n.batch, n.heads, n.queries, 1];
    let part = alloc(client, part_shape, 4);
    let part_lse = alloc(client, part_lse_shape, 4);
    split(
        contiguous(part_shape, &part),
        contiguous(part_lse_shape, &part_lse),
        f32_elem,
    );
    let units = 256;
    launch!(plain combine_kernel(
        client,
        grid(client, (rows * n.d_v).div_ceil(units)),
        CubeDim::new_1d(units as u32),
        contiguous(part_shape, &part),
        contiguous(part_lse_shape, &part_lse),
        heads_inside(out_shape, &out),
        contiguous(lse_shape, &lse),
        inputs.elem,
    ));
    (out, lse)
}

/// The gradients (in the inputs' dtype, of the inputs' shapes, laid out as the heads of a
/// `[B, T, heads·D]` tensor) of attention over `inputs` under `scoring`, from its output
/// `out` and log-sum-exp `lse` (as [`forward`] writes them) and the output's gradient
/// `grad` (`[B, H, Tq, Dv]`, any strides); and, where `[.., bias, pd]` ask for them, of the
/// bias (of its own shape, contiguous: summed over the axes it broadcasts along) and of
/// the bias by distance (`[1, 1, H, Tq + Tk - 1]`). dQ's kernel runs only where
/// `[q, kv, ..]` asks for the query's gradient or the bias's or the table's are asked for,
/// dK's and dV's only where it asks for theirs: a gradient not asked for holds nothing
/// meaningful.
///
/// With `packed`, dQ, dK and dV are written side by side into one new `[B, T, (H +
/// 2·Hkv)·D]` tensor, the gradient of a packed projection's output (see [`packed`]):
/// `Grads::dq` is then that tensor, and `dk` and `dv` bind its later columns.
///
/// # Panics
/// If the shapes disagree or the sizes pass `i32`; with `packed`, if the queries and
/// keys differ in number or head dim, or the key's and value's columns do not start at
/// the device's alignment for bindings.
pub(crate) fn backward(
    client: &Client,
    inputs: &Inputs,
    scoring: Scoring,
    [out, lse]: [&TensorBinding; 2],
    grad: &TensorBinding,
    [q_grad, kv_grad, bias_grad, pd_grad]: [bool; 4],
    packed: bool,
) -> Grads {
    let n = inputs.dims();
    let row_shape = [n.batch, n.heads, n.queries, 1];
    assert_laid_out("log-sum-exp", lse, row_shape, contiguous_strides(row_shape));
    let shared = client.properties().hardware.max_shared_memory_size;
    let (_, mut tq, tkv) = tiles(
        &n,
        inputs.size,
        shared,
        scoring.softcap.is_some(),
        cooperative(client, inputs.elem),
    );
    let row_shape = [n.batch, n.heads, n.queries, 1];
    let dq_shape = [n.batch, n.heads, n.queries, n.d_k];
    let dk_shape = [n.batch, n.kv_heads, n.keys, n.d_k];
    let dv_shape = [n.batch, n.kv_heads, n.keys, n.d_v];
    let ([dq, dk, dv], [dq_strides, dk_strides, dv_strides]) = match packed {
        true => packed_grads(client, &n, inputs.size),
        false => (
            [dq_shape, dk_shape, dv_shape].map(|shape| alloc(client, shape, inputs.size)),
            [dq_shape, dk_shape, dv_shape].map(heads_inside_strides),
        ),
    };
    let delta = alloc(client, row_shape, 4);

    let rows = n.batch * n.heads * n.queries;
    let units = 64;
    delta_kernel::launch(
        client,
        grid(client, rows.div_ceil(units)),
        CubeDim::new_1d(units as u32),
        out.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        contiguous(row_shape, &delta),
        n.d_v,
        inputs.elem,
    );

    // The partial rows of the bias gradients: zeros where no cube writes.
    let blocks = n.queries.div_ceil(tq.bq);
    let bias_partial = inputs.bias.as_ref().filter(|_| bias_grad).map(|bias| {
        let [sb, sh, sq, sk] = dims(bias);
        tq.bias = BiasSums::Some {
            queries: sq > 1,
            keys: sk > 1,
        };
        let elements = sb * sh * sq * sk;
        let sums = bias_sums([n.batch, n.heads, n.queries], blocks, [sb, sh, sq, sk]);
        let rows = sums.expect("gpu attention: bias sums past usize") / elements;
        zeros(client, rows, elements)
    });
    let pd_partial = inputs.pd.as_ref().filter(|_| pd_grad).map(|_| {
        tq.pd = true;
        let elements = n.heads * (n.queries + n.keys - 1);
        let sums = table_sums([n.batch, n.heads, n.queries, n.keys], blocks);
        zeros(
            client,
            sums.expect("gpu attention: table sums past usize") / elements,
            elements,
        )
    });
    let partial_arg = |p: &Option<(Handle, [usize; 2])>| match p {
        Some((handle, [rows, elements])) => {
            ComptimeOptionArgs::Some(matrix([*rows, *elements], handle))
        }
        None => ComptimeOptionArgs::None,
    };
    let width = inputs.width(Some(grad));
    // dQ's kernel also sums the bias's and the table's partial rows.
    if q_grad || bias_partial.is_some() || pd_partial.is_some() {
        launch!(
            tq.frag,
            dq_kernel(
                client,
                grid(client, blocks * n.batch * n.heads),
                CubeDim::new_1d(tq.units as u32),
                width,
                inputs.problem(&n, scoring),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                contiguous(row_shape, &delta),
                raw(dq_shape, dq_strides, &dq),
                partial_arg(&bias_partial),
                partial_arg(&pd_partial),
                tq,
                [inputs.elem, inputs.mask_elem, weights(tq.frag, inputs.elem)],
            )
        );
    }
    if kv_grad {
        launch!(
            tkv.frag,
            dkv_kernel(
                client,
                grid(client, n.keys.div_ceil(tkv.bk) * n.batch * n.kv_heads),
                CubeDim::new_1d(tkv.units as u32),
                width,
                inputs.problem(&n, scoring),
                grad.clone().into_tensor_arg(),
                lse.clone().into_tensor_arg(),
                contiguous(row_shape, &delta),
                raw(dk_shape, dk_strides, &dk),
                raw(dv_shape, dv_strides, &dv),
                tkv,
                [
                    inputs.elem,
                    inputs.mask_elem,
                    weights(tkv.frag, inputs.elem)
                ],
            )
        );
    }
    Grads {
        dq,
        dk,
        dv,
        dbias: bias_partial.map(|p| sum_rows(client, p, inputs.elem, inputs.size)),
        dpd: pd_partial.map(|p| sum_rows(client, p, inputs.elem, inputs.size)),
    }
}

/// Whether a packed call's gradients can be written in place (see [`backward`]): the
/// key's and the value's columns of the packed `[B, T, (H + 2·Hkv)·D]` tensor start at
/// the alignment the device asks of a binding's offset (every Vulkan device takes 256
/// bytes; lavapipe less).
pub(crate) fn packed(client: &Client, [heads, kv_heads, d]: [usize; 3], size: usize) -> bool {
    let alignment = client.properties().memory.alignment as usize;
    [heads, heads + kv_heads]
        .iter()
        .all(|&h| (h * d * size).is_multiple_of(alignment))
}

/// One `[B, T, (H + 2·Hkv)·D]` buffer for dQ, dK and dV side by side: the handles of
/// their first columns and the strides of each as `[B, heads, T, D]`.
fn packed_grads(client: &Client, n: &Dims, size: usize) -> ([Handle; 3], [[usize; 4]; 3]) {
    assert!(
        n.queries == n.keys && n.d_k == n.d_v,
        "packed gradients of {} queries and {} keys, head dims {} and {}",
        n.queries,
        n.keys,
        n.d_k,
        n.d_v
    );
    assert!(
        packed(client, [n.heads, n.kv_heads, n.d_k], size),
        "packed gradients with the key's columns at {} bytes",
        n.heads * n.d_k * size
    );
    let width = (n.heads + 2 * n.kv_heads) * n.d_k;
    let whole = buffer(client, n.batch * n.queries * width * size);
    let at = |heads: usize| whole.clone().offset_start((heads * n.d_k * size) as u64);
    let strides = [n.queries * width, n.d_k, width, 1];
    (
        [whole.clone(), at(n.heads), at(n.heads + n.kv_heads)],
        [strides; 3],
    )
}

/// The gradients of one call (in the inputs' dtype): of the query, key and value (laid
/// out as [`backward`] says), and, when asked for, of the bias and of the bias by
/// distance (contiguous).
pub(crate) struct Grads {
    pub(crate) dq: Handle,
    pub(crate) dk: Handle,
    pub(crate) dv: Handle,
    pub(crate) dbias: Option<Handle>,
    pub(crate) dpd: Option<Handle>,
}

/// Elements of the partial sums (f32) of the gradient of a bias of dims `[sb, sh, sq, sk]`
/// in a call of `[B, H, Tq]` queries in `blocks` blocks: rows of the bias's elements, one
/// for each batch row and head it is shared by, times each block where it has keys but no
/// queries, or each query where it has neither.
pub(crate) fn bias_sums(
    [batch, heads, queries]: [usize; 3],
    blocks: usize,
    [sb, sh, sq, sk]: [usize; 4],
) -> Option<usize> {
    let rows = match (sq > 1, sk > 1) {
        (true, _) => 1,
        (false, true) => blocks,
        (false, false) => queries,
    };
    let shared = if sb == 1 { batch } else { 1 } * if sh == 1 { heads } else { 1 };
    [shared, sb, sh, sq, sk]
        .into_iter()
        .try_fold(rows, usize::checked_mul)
}

/// Elements of the partial sums (f32) of a learned position table's gradient in a call of
/// `[B, H, Tq, Tk]` in `blocks` blocks of queries: a row of every head's distances for
/// each block of each batch row.
pub(crate) fn table_sums(
    [batch, heads, queries, keys]: [usize; 4],
    blocks: usize,
) -> Option<usize> {
    [blocks, heads, (queries + keys).saturating_sub(1)]
        .into_iter()
        .try_fold(batch, usize::checked_mul)
}

/// The most blocks `queries` queries are cut into by the kernels' tiles (the smallest
/// block of [`CANDIDATES`]).
pub(crate) fn most_query_blocks(queries: usize) -> usize {
    let smallest = CANDIDATES.iter().map(|&(_, q, _)| q).min().unwrap_or(1);
    queries.div_ceil(smallest)
}

/// `rows x elements` f32 zeros.
fn zeros(client: &Client, rows: usize, elements: usize) -> (Handle, [usize; 2]) {
    let len = rows * elements;
    let handle = buffer(client, len * 4);
    let units = 256;
    zeros_kernel::launch(
        client,
        grid(client, len.div_ceil(units)),
        CubeDim::new_1d(units as u32),
        matrix([1, len], &handle),
        within(len) as u32,
    );
    (handle, [rows, elements])
}

/// The sum of the partial rows `[rows, elements]` (f32), in order, as one row in `elem`:
/// [`CHUNK`] rows at a time, so that no invocation loops over more.
fn sum_rows(
    client: &Client,
    (mut partial, [mut rows, elements]): (Handle, [usize; 2]),
    elem: ElemType,
    size: usize,
) -> Handle {
    let units = 64;
    loop {
        let chunks = rows.div_ceil(CHUNK);
        let last = chunks == 1;
        let out = buffer(client, chunks * elements * if last { size } else { 4 });
        let CubeCount::Static(x, y, _) = grid(client, elements.div_ceil(units)) else {
            unreachable!("a static grid")
        };
        reduce_kernel::launch(
            client,
            CubeCount::Static(x, y, chunks as u32),
            CubeDim::new_1d(units as u32),
            matrix([rows, elements], &partial),
            matrix([chunks, elements], &out),
            CHUNK as u32,
            if last {
                elem
            } else {
                ElemType::Float(cubecl::ir::FloatKind::F32)
            },
        );
        if last {
            return out;
        }
        (partial, rows) = (out, chunks);
    }
}

/// `n` as an `i32`, the kernels' index type for positions.
///
/// # Panics
/// Past `i32::MAX`.
pub(crate) fn within(n: usize) -> i32 {
    i32::try_from(n).expect("gpu attention: a size past i32")
}

/// The four sizes of a rank-4 binding.
pub(crate) fn dims(t: &TensorBinding) -> [usize; 4] {
    assert!(
        t.shape.len() == 4,
        "gpu attention: a tensor of shape {:?}",
        t.shape
    );
    std::array::from_fn(|axis| t.shape[axis])
}

/// A new buffer of `shape` in elements of `size` bytes.
pub(crate) fn alloc(client: &Client, shape: [usize; 4], size: usize) -> Handle {
    buffer(client, shape.iter().product::<usize>() * size)
}

/// A new buffer of `bytes` bytes (followed, in the tests that ask for one, by a guard
/// whose bytes show a write past the tensor).
fn buffer(client: &Client, bytes: usize) -> Handle {
    #[cfg(test)]
    if super::tests::GUARD.get() > 0 {
        let guard = super::tests::GUARD.get();
        let mut data = vec![0u8; bytes];
        data.resize(bytes + guard, 0xFF);
        return client.create_from_slice(&data);
    }
    client.empty(bytes)
}

/// The element type, its size and its blocked-bias sentinel for the float tensors of a
/// call in `dtype`.
///
/// # Panics
/// Unless `dtype` is f32, f16 or bf16.
pub(crate) fn element(dtype: burn::tensor::DType) -> (ElemType, usize, f32) {
    use burn::tensor::DType;
    let kind = match dtype {
        DType::F32 => cubecl::ir::FloatKind::F32,
        DType::F16 => cubecl::ir::FloatKind::F16,
        DType::BF16 => cubecl::ir::FloatKind::BF16,
        other => panic!("gpu attention: tensors of {other:?}"),
    };
    let blocked = crate::mask::blocked_score(dtype);
    (ElemType::Float(kind), dtype.size(), blocked)
}

/// The strides of a contiguous tensor of `shape`.
pub(crate) fn contiguous_strides(shape: [usize; 4]) -> [usize; 4] {
    [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ]
}

/// The strides of a `[B, H, T, D]` tensor laid out `[B, T, H, D]`: the heads of a `[B, T,
/// H·D]` tensor, which a module's projections give and take without a copy.
pub(crate) fn heads_inside_strides(shape: [usize; 4]) -> [usize; 4] {
    let [_, heads, len, d] = shape;
    match d {
        // One feature a head: contiguous instead. Laid out with the heads inside, the heads
        // and the features both have stride 1, which Burn's wgpu backend misreads through
        // some later operations (a reduction over the features, `q · mean(q²)`, took its
        // gradient's values from the wrong places).
        1 => contiguous_strides(shape),
        _ => [len * heads * d, d, heads * d, 1],
    }
}

/// `handle` as a contiguous tensor of `shape`.
pub(crate) fn contiguous(shape: [usize; 4], handle: &Handle) -> TensorArg {
    raw(shape, contiguous_strides(shape), handle)
}

/// `handle` as a `[B, H, T, D]` tensor laid out `[B, T, H, D]`.
pub(crate) fn heads_inside(shape: [usize; 4], handle: &Handle) -> TensorArg {
    raw(shape, heads_inside_strides(shape), handle)
}

/// `handle` as a contiguous matrix `[rows, columns]`.
fn matrix([rows, columns]: [usize; 2], handle: &Handle) -> TensorArg {
    // SAFETY: `handle` was allocated for `rows · columns` elements, row by row.
    unsafe {
        TensorArg::from_raw_parts(
            handle.clone(),
            vec![columns, 1].into(),
            vec![rows, columns].into(),
        )
    }
}

fn raw(shape: [usize; 4], strides: [usize; 4], handle: &Handle) -> TensorArg {
    // SAFETY: `handle` was allocated for `shape`'s elements laid out at `strides` (a
    // permutation of a contiguous layout), or binds the columns of a packed tensor from
    // its first (`packed_grads`), whose elements at `strides` lie within the buffer.
    unsafe {
        TensorArg::from_raw_parts(
            handle.clone(),
            strides.to_vec().into(),
            shape.to_vec().into(),
        )
    }
}

/// `t` with stride 0 along its axes of size 1, so that the kernels read it as broadcast.
fn broadcast(mut t: TensorBinding) -> TensorBinding {
    let shape = dims(&t);
    let strides: Vec<usize> = (0..4)
        .map(|axis| if shape[axis] == 1 { 0 } else { t.strides[axis] })
        .collect();
    t.strides = strides.into();
    t
}

/// # Panics
/// Unless `t` is a tensor of `shape` laid out at `strides` (what the kernels write and
/// read back).
pub(crate) fn assert_laid_out(
    what: &str,
    t: &TensorBinding,
    shape: [usize; 4],
    strides: [usize; 4],
) {
    let laid_out = (0..4).all(|a| shape[a] <= 1 || t.strides[a] == strides[a]);
    assert!(
        dims(t) == shape && laid_out,
        "gpu attention: the {what} has shape {:?} and strides {:?}, want {shape:?} at {strides:?}",
        t.shape,
        t.strides
    );
}

#[cfg(test)]
mod tests {
    use cubecl::features::MmaConfig;
    use cubecl::ir::FloatKind;

    use super::*;

    const F16: ElemType = ElemType::Float(FloatKind::F16);
    const BF16: ElemType = ElemType::Float(FloatKind::BF16);
    const F32: ElemType = ElemType::Float(FloatKind::F32);

    #[test]
    fn the_band_arguments_give_every_query_and_key_their_keys_and_queries() {
        use crate::mask::{AttentionMask, CausalAlignment};
        let clip = |lo: i64, hi: i64, n: usize| {
            let (lo, hi) = (lo.max(0), hi.min(n as i64));
            match lo < hi {
                true => lo as usize..hi as usize,
                false => 0..0,
            }
        };
        let masks = [
            AttentionMask::none(),
            AttentionMask::causal(),
            AttentionMask::sliding_window(3),
            AttentionMask::local(2),
            AttentionMask::local(60),
            AttentionMask::sliding_window(50).and(AttentionMask::local(1)),
        ];
        let alignments = [
            CausalAlignment::BottomRight,
            CausalAlignment::TopLeft,
            CausalAlignment::Offset(7),
            CausalAlignment::Offset(100),
            CausalAlignment::Offset(-40),
            CausalAlignment::Offset(-(1 << 40)),
            CausalAlignment::Offset(1 << 40),
        ];
        for (queries, keys) in [(1, 1), (4, 3), (13, 4), (5, 30), (9, 9)] {
            let dims = Dims::of([[1, 1, queries, 8], [1, 1, keys, 8], [1, 1, keys, 8]]);
            for mask in &masks {
                for alignment in alignments {
                    let mask = mask.clone().aligned(alignment);
                    let seen = mask.rule().visibility(queries, keys);
                    let [offset, before, after] = band(&dims, seen.band()).map(i64::from);
                    let case = format!("{mask:?} at [{queries}, {keys}]");
                    for i in 0..queries {
                        let own = i as i64 + offset;
                        let got = clip(own - before, own + after + 1, keys);
                        assert_eq!(got, seen.keys_of(0, i), "{case}: query {i}");
                    }
                    for j in 0..keys {
                        let own = j as i64 - offset;
                        let got = clip(own - after, own + before + 1, queries);
                        assert_eq!(got, seen.queries_of(0, j), "{case}: key {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn asked_tiles_are_one_of_the_candidates_and_go_first() {
        let all = |tiles| Some(Asked(vec![(None, None, tiles)]));
        assert_eq!(parse_tiles(""), Some(Asked::default()));
        assert_eq!(parse_tiles("auto"), Some(Asked::default()));
        assert_eq!(parse_tiles(" 64, 32,32 "), all((64, 32, 32)));
        assert_eq!(parse_tiles("all=64,32,32;"), all((64, 32, 32)));
        for wrong in [
            "64,32",
            "64,32,32,1",
            "64,32,x",
            "64,64,64",
            "-1,32,32",
            "fwd=64,32,32",
            "forward@f64=64,32,32",
            "forward@f16",
            "forward=64,32,32;dq=64,64,64",
        ] {
            assert_eq!(parse_tiles(wrong), None, "{wrong:?}");
        }
        assert_eq!(preference(None), CANDIDATES);
        for (at, &first) in CANDIDATES.iter().enumerate() {
            let order = preference(Some(first));
            assert_eq!(order[0], first);
            // The others keep their order behind it.
            let rest: Vec<_> = CANDIDATES.iter().copied().filter(|&c| c != first).collect();
            assert_eq!(order[1..], rest[..], "candidate {at}");
        }
    }

    #[test]
    fn asked_tiles_for_a_kernel_and_dtype_go_to_it_the_most_specific_first() {
        // What `gpu_table.py --best-tiles` writes, and a default for the rest.
        let asked = parse_tiles(
            "32,16,32; forward@f16=128,64,64; dkv@f32=64,32,32; @f32=128,64,32; \
             dq=32,32,16; dq@bf16=16,16,16; dq@f16=64,32,32",
        )
        .expect("taken");
        let first = |kernel, size| asked.first(kernel, size);
        assert_eq!(first(Kernel::Forward, 2), Some((128, 64, 64)));
        assert_eq!(first(Kernel::Forward, 4), Some((128, 64, 32)));
        assert_eq!(first(Kernel::Dkv, 4), Some((64, 32, 32)));
        assert_eq!(first(Kernel::Dkv, 2), Some((32, 16, 32)));
        assert_eq!(first(Kernel::Dq, 4), Some((32, 32, 16)));
        // f16 and bf16 are one width: the later entry of the two.
        assert_eq!(first(Kernel::Dq, 2), Some((64, 32, 32)));
        assert_eq!(Asked::default().first(Kernel::Dq, 2), None);
        // The dtype alone, without a kernel.
        let asked = parse_tiles("@f16=64,32,32").expect("taken");
        assert_eq!(asked.first(Kernel::Dkv, 2), Some((64, 32, 32)));
        assert_eq!(asked.first(Kernel::Dkv, 4), None);
    }

    #[test]
    fn asked_portable_tiles_may_take_what_the_device_has_up_to_48_kib() {
        let dims = Dims::of([[1, 8, 300, 64], [1, 8, 300, 64], [1, 8, 300, 64]]);
        let taken = |shared, size, asked| {
            let f: ForwardTiles = choose(&dims, size, shared, Fragment::NONE, asked);
            let q: DqTiles = choose(&dims, size, shared, Fragment::NONE, asked);
            let kv: DkvTiles = choose(&dims, size, shared, Fragment::NONE, asked);
            for bytes in [
                f.shared_bytes(size),
                q.shared_bytes(size),
                kv.shared_bytes(size),
            ] {
                assert!(bytes <= shared.min(48 * 1024), "{bytes} bytes of {shared}");
            }
            [f.taken(), q.taken(), kv.taken()].map(|(u, bq, bk, _)| (u, bq, bk))
        };
        let large = (128, 64, 32);
        // Unasked, f32 stays within 32 KiB on a device of 48.
        let default = taken(48 * 1024, 4, None);
        assert!(default.iter().all(|&t| t != large), "{default:?}");
        // Asked, the forward takes it there, past 32 KiB (the others where they fit).
        let f = ForwardTiles::new(128, 64, 32, 64, 64);
        assert!(f.shared_bytes(4) > SHARED_BUDGET && f.shared_bytes(4) <= ASKED_BUDGET);
        assert_eq!(taken(48 * 1024, 4, Some(large))[0], large);
        // On a device of 32 KiB the asked tiles do not fit: the default ones instead.
        assert_eq!(taken(32 * 1024, 4, Some(large)), taken(32 * 1024, 4, None));
        for (size, asked) in [(4, large), (2, (128, 64, 64))] {
            println!(
                "{size}-byte inputs, 48 KiB: (units, queries, keys) forward, dQ, dK/dV \
                 {:?} asked {asked:?}, {:?} unasked",
                taken(48 * 1024, size, Some(asked)),
                taken(48 * 1024, size, None)
            );
        }
    }

    #[test]
    fn the_fragment_is_the_largest_the_device_reports_for_the_dtype_with_f32_sums() {
        let mut props = offline_device(32, None);
        let shapes = [
            (F16, F32, [16, 8, 16]),
            (F16, F16, [32, 32, 16]),
            (F16, F32, [16, 16, 16]),
        ];
        for (ab, cd, [m, n, k]) in shapes {
            props.features.matmul.cmma.insert(MmaConfig {
                a_type: ab,
                b_type: ab,
                cd_type: cd,
                m,
                n,
                k,
            });
        }
        let frag = fragment(&props, F16).expect("f16 fragments");
        assert_eq!((frag.m, frag.n, frag.k, frag.plane), (16, 16, 16, 32));
        // No bf16 shape reported; f32 is never multiplied on them.
        let e = fragment(&props, BF16).unwrap_err();
        assert!(e.contains("BF16"), "{e}");
        assert!(fragment(&props, F32).unwrap_err().contains("f16 or bf16"));
        // Subgroups of varying size: a fragment belongs to one of a known size.
        props.hardware.plane_size_min = 8;
        assert!(fragment(&props, F16).unwrap_err().contains("8 to 32"));
        // None reported (WGSL, lavapipe before it had them).
        assert!(fragment(&offline_device(32, None), F16).is_err());
    }

    #[test]
    fn cooperative_tiles_are_whole_fragments_within_48_kib_or_the_portable_ones() {
        for (shape, plane) in [([16, 16, 16], 32), ([8, 8, 8], 8)] {
            let props = offline_device(plane, Some(shape));
            let frag = fragment(&props, F16).expect("reported");
            for d in [64, 128] {
                let dims = Dims::of([[1, 8, 300, d], [1, 2, 300, d], [1, 2, 300, d]]);
                let (forward, dq, dkv) = tiles(&dims, 2, 48 * 1024, false, frag);
                assert_eq!(
                    (forward.frag, dq.frag, dkv.frag),
                    (frag, frag, frag),
                    "d {d}"
                );
                for p in [
                    forward.s, forward.o, dq.s, dq.dp, dq.dq, dkv.s, dkv.dp, dkv.dv, dkv.dk,
                ] {
                    assert!(frag.fits(&p), "d {d}: {p:?} in {frag:?}");
                }
                for bytes in [
                    forward.shared_bytes(2),
                    dq.shared_bytes(2),
                    dkv.shared_bytes(2),
                ] {
                    assert!(bytes <= COOPERATIVE_BUDGET, "d {d}: {bytes} bytes");
                }
                // The operands' rows 16 bytes apart.
                assert!(forward.q().stride().is_multiple_of(8));
                println!(
                    "{shape:?} d {d}: (units, queries, keys) forward {:?}, dQ {:?}, dK/dV {:?}",
                    (forward.units, forward.bq, forward.bk),
                    (dq.units, dq.bq, dq.bk),
                    (dkv.units, dkv.bq, dkv.bk),
                );
            }
            // A head dim that is no whole fragment: the portable tiles, within 32 KiB.
            let dims = Dims::of([[1, 8, 300, 20], [1, 2, 300, 20], [1, 2, 300, 20]]);
            let (forward, dq, dkv) = tiles(&dims, 2, 48 * 1024, false, frag);
            let portable = tiles(&dims, 2, 48 * 1024, false, Fragment::NONE);
            assert_eq!(
                (forward, dq, dkv),
                portable,
                "{shape:?}: head dim 20 takes the portable tiles"
            );
            assert!(!forward.frag.is_some() && forward.shared_bytes(2) <= SHARED_BUDGET);
        }
    }
}
