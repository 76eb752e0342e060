//! Devices, fixtures, comparisons and seeded random inputs shared by the tests.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, FloatDType, Gradients, Tensor, TensorData};
use mha::PyTorchWeights;

/// A backend under test: its name and device; a GPU backend holds the [`GpuTurn`] while
/// it lives.
#[derive(Clone, Debug)]
pub struct Backend {
    pub name: &'static str,
    pub device: Device,
    _turn: Option<Rc<GpuTurn>>,
}

/// The GPU to one test thread at a time. Burn's autotuner marks a kernel choice pending
/// while one thread measures the candidates, and another thread asking for that choice
/// meanwhile runs the first candidate instead of the winner: two runs of one computation
/// on one thread could then take different kernels and round differently, and the tests
/// that compare two runs bit for bit would fail by chance. A thread may take its turn
/// again while it holds it.
#[derive(Debug)]
pub struct GpuTurn {
    _guard: Option<MutexGuard<'static, ()>>,
}

static GPU: Mutex<()> = Mutex::new(());

thread_local! {
    /// The turns this thread holds.
    static TURNS: Cell<usize> = const { Cell::new(0) };
}

/// Waits for the GPU's turn (at once if this thread holds it) and holds it until dropped.
pub fn gpu_turn() -> GpuTurn {
    let guard = (TURNS.get() == 0).then(|| GPU.lock().unwrap_or_else(PoisonError::into_inner));
    TURNS.set(TURNS.get() + 1);
    GpuTurn { _guard: guard }
}

impl Drop for GpuTurn {
    fn drop(&mut self) {
        TURNS.set(TURNS.get() - 1);
    }
}

impl Backend {
    /// The backend `name` on `device`, holding the [`GpuTurn`] if it is a GPU's.
    fn new(name: &'static str, device: Device) -> Self {
        Self {
            name,
            device,
            _turn: is_gpu(name).then(|| Rc::new(gpu_turn())),
        }
    }

    /// Max abs error allowed against PyTorch for forward values.
    pub fn forward_tol(&self) -> f32 {
        match self.is_gpu() {
            // A real GPU reorders its reductions and approximates exp and tanh (lavapipe
            // does not: worst measured there 3.6e-6, a layer norm of a strided view).
            true => 1e-4,
            // Values up to ~30 summed in another order than PyTorch's: a few ulp; worst
            // measured 3.0e-6 (layer norm rows with means 30x their spread), attention 5e-7.
            false => 1e-5,
        }
    }

    /// Max abs error allowed against PyTorch for gradients.
    pub fn grad_tol(&self) -> f32 {
        match self.is_gpu() {
            // The forward's reasons through a backward pass twice as deep; worst measured
            // on lavapipe 6.1e-5 (as on the CPU, below).
            true => 1e-3,
            // Gradients reach ~300 (a layer norm of a constant row: 1/√ε), a few ulp of
            // which is the worst measured, 6.1e-5; attention's at most 8.3e-7.
            false => 1e-4,
        }
    }

    /// `[atol, rtol]` of gradients against PyTorch's, the bound `atol + rtol · largest`
    /// taken for each tensor with its largest expected magnitude.
    pub fn grad_tolerance(&self) -> [f32; 2] {
        match self.is_gpu() {
            // The forward's reasons (see `forward_tol`), ten times the CPU's; worst
            // measured on lavapipe 8.2e-7 of the largest, as the CPU (not yet measured on
            // a GPU that approximates exp and tanh).
            true => [1e-7, 2e-5],
            // Worst measured 8.1e-7 of the largest (flex and ndarray: Qwen3's q_norm,
            // 2.8e-7 of 0.35); cross-entropy's logits' gradient, at most 1.4e-3, 1.2e-10.
            false => [1e-8, 2e-6],
        }
    }

    /// `[atol, rtol]` of the forward values and of the gradients in `dtype`, against
    /// attention computed in f64 from the same inputs (rounded to `dtype`): f32 as
    /// [`forward_tol`](Self::forward_tol) and [`grad_tol`](Self::grad_tol). The
    /// half-precision `rtol` are PyTorch's `torch.testing` defaults (1e-3 for f16, 1.6e-2
    /// for bf16); the `atol` are about 2.5 times the worst errors measured on flex, whose
    /// half-precision matmul and softmax round every step (f16: output 1.8e-3, gradients
    /// 7e-3; bf16: 1.1e-2 and 3.8e-2, with values and gradients of order 1).
    pub fn tolerances(&self, dtype: FloatDType) -> [[f64; 2]; 2] {
        match dtype {
            // f64 against f64: only the order of the sums differs (worst measured on
            // flex 1.3e-14, a dk of values near 8).
            FloatDType::F64 => [[1e-12, 0.0], [1e-12, 0.0]],
            FloatDType::F16 => [[5e-3, 1e-3], [2e-2, 1e-3]],
            FloatDType::BF16 => [[3e-2, 1.6e-2], [1e-1, 1.6e-2]],
            // f32: as against PyTorch (the f64 reference is rounded to f32 once).
            _ => [
                [self.forward_tol() as f64, 0.0],
                [self.grad_tol() as f64, 0.0],
            ],
        }
    }

    /// [`tolerances`](Self::tolerances) against a reference computed in f32 (PyTorch's
    /// fixtures, an f32 module), for values and for gradients of order 1 (a gradient's
    /// bound is scaled by its largest value): f64 is held to the reference's own
    /// rounding, f32's [`forward_tol`](Self::forward_tol) and the relative part of
    /// [`grad_tolerance`](Self::grad_tolerance).
    pub fn tolerances_against_f32(&self, dtype: FloatDType) -> [[f64; 2]; 2] {
        match dtype {
            FloatDType::F64 => [
                [self.forward_tol() as f64, 0.0],
                [0.0, self.grad_tolerance()[1] as f64],
            ],
            _ => self.tolerances(dtype),
        }
    }

    /// The float dtypes besides f32 this backend stores: flex all three; ndarray f64 only
    /// (it has no half-precision arrays); wgpu f16 (Vulkan has no f64 in Burn's wgpu).
    pub fn other_float_dtypes(&self) -> Vec<FloatDType> {
        match self.name {
            "flex" => vec![FloatDType::F64, FloatDType::F16, FloatDType::BF16],
            "ndarray" => vec![FloatDType::F64],
            _ => vec![FloatDType::F16],
        }
    }

    fn is_gpu(&self) -> bool {
        is_gpu(self.name)
    }

    /// The same device with autodiff.
    pub fn autodiff(&self) -> Device {
        self.device.clone().autodiff()
    }
}

/// Makes a backend's device.
type MakeDevice = fn() -> Device;

/// Whether the backend of this name runs on a GPU.
fn is_gpu(name: &str) -> bool {
    matches!(name, "wgpu" | "cuda")
}

/// Every backend compiled in: flex by default, ndarray, wgpu and cuda by feature, each made
/// when the iteration reaches it (a GPU backend waits for the [`GpuTurn`] then).
#[allow(deprecated, clippy::vec_init_then_push)]
pub fn backends() -> impl Iterator<Item = Backend> {
    let mut all: Vec<(&'static str, MakeDevice)> = Vec::new();
    #[cfg(feature = "flex")]
    all.push(("flex", Device::flex));
    #[cfg(feature = "ndarray")]
    all.push(("ndarray", Device::ndarray));
    #[cfg(feature = "wgpu")]
    all.push(("wgpu", || {
        Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
    }));
    #[cfg(feature = "cuda")]
    all.push(("cuda", || Device::cuda(0)));
    assert!(!all.is_empty(), "no backend feature enabled");
    all.into_iter()
        .map(|(name, device)| Backend::new(name, device()))
}

/// The first backend's device (flex in every build CI makes), for the tests that check
/// what does not depend on the backend. It holds no [`GpuTurn`]: in a build without flex, a
/// test comparing two GPU runs bit for bit on it could fail by chance.
pub fn first_device() -> Device {
    backends().next().expect("a backend").device
}

/// The repository's root: the one `cargo test` runs the tests from (it sets
/// `CARGO_MANIFEST_DIR` at run time too), else the one they were built in. A test binary
/// reused from a build cache shared by several clones reads the files of its own clone.
pub fn root() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into())
        .into()
}

/// A PyTorch fixture written by scripts/golden.py.
pub struct Fixture {
    pub name: &'static str,
    pub weights: PyTorchWeights,
}

impl Fixture {
    pub fn load(name: &'static str) -> Self {
        let path = root().join(format!("tests/fixtures/{name}.safetensors"));
        let weights = PyTorchWeights::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        Self { name, weights }
    }

    /// The tensor `io.<key>`, checked to have shape `shape`.
    pub fn io<const D: usize>(&self, key: &str, shape: [usize; D], device: &Device) -> Tensor<D> {
        self.weights
            .tensor(&format!("io.{key}"), shape, device)
            .unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    /// `io.<key>` as a boolean mask (stored as 1.0 = blocked).
    pub fn io_mask<const D: usize>(
        &self,
        key: &str,
        shape: [usize; D],
        device: &Device,
    ) -> Tensor<D, burn::tensor::Bool> {
        self.io(key, shape, device).greater_elem(0.5)
    }
}

/// Largest absolute difference; panics on a shape mismatch or a non-finite value.
pub fn max_abs_diff<const D: usize>(actual: Tensor<D>, expected: Tensor<D>) -> f32 {
    assert_eq!(actual.dims(), expected.dims(), "shape mismatch");
    let a = to_vec(actual);
    let e = to_vec(expected);
    assert!(
        a.iter().all(|v| v.is_finite()),
        "non-finite value in result"
    );
    a.iter()
        .zip(&e)
        .map(|(a, e)| (a - e).abs())
        .fold(0.0, f32::max)
}

/// The weights a call returned, `Some` where `asked` asks for them and `None` where it
/// does not; anything else panics naming `what`, so that a comparison of the weights
/// cannot vanish with them.
pub fn asked_weights<const D: usize>(
    what: &str,
    asked: mha::AttentionWeights,
    weights: Option<Tensor<D>>,
) -> Option<Tensor<D>> {
    match (asked, weights) {
        (mha::AttentionWeights::None, None) => None,
        (mha::AttentionWeights::None, Some(_)) => panic!("{what}: weights none asked for"),
        (asked, None) => panic!("{what}: {asked:?} weights asked for, none returned"),
        (_, weights) => weights,
    }
}

/// Asserts a gradient close to PyTorch's, each tensor against its own size: `max |actual -
/// expected| <= atol + rtol · max |expected|` with `b`'s [`grad_tolerance`]
/// (Backend::grad_tolerance), so that a gradient of 1e-3 is held to the digits a gradient
/// of 300 is. Prints the error and the bound.
pub fn assert_grad_close<const D: usize>(
    b: &Backend,
    what: &str,
    actual: Tensor<D>,
    expected: Tensor<D>,
) -> f32 {
    let largest = expected.clone().abs().max().into_scalar::<f32>();
    let [atol, rtol] = b.grad_tolerance();
    let tol = atol + rtol * largest;
    let err = max_abs_diff(actual, expected);
    println!("{what}: max abs error {err:.2e} (tolerance {tol:.1e}, largest {largest:.1e})");
    assert!(
        err <= tol,
        "{what}: max abs error {err:e} > {tol:e} ({atol:e} + {rtol:e} x the largest {largest:e})"
    );
    err
}

/// Asserts `max |actual - expected| <= tol`, printing the measured error.
pub fn assert_close<const D: usize>(
    what: &str,
    actual: Tensor<D>,
    expected: Tensor<D>,
    tol: f32,
) -> f32 {
    let err = max_abs_diff(actual, expected);
    println!("{what}: max abs error {err:.2e} (tolerance {tol:.0e})");
    assert!(err <= tol, "{what}: max abs error {err:e} > {tol:e}");
    err
}

/// Runs `f` and returns its panic's message (a `String`, or the `&str` of a message
/// without arguments).
pub fn panic_message(f: impl FnOnce()) -> String {
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("a panic");
    match err.downcast::<String>() {
        Ok(message) => *message,
        Err(err) => err
            .downcast::<&str>()
            .map(|m| m.to_string())
            .unwrap_or_default(),
    }
}

pub fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// Seeded normal tensor, generated on the host so every backend sees the same numbers.
pub fn randn<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let mut rng = SplitMix(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A small deterministic generator (SplitMix64) for reproducible inputs on every backend.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
}

/// Every float parameter of a module, flattened, in visiting order.
pub fn param_values<M: Module>(module: &M) -> Vec<Tensor<1>> {
    collect(module, None)
}

/// The gradient of every float parameter, flattened, in visiting order.
pub fn param_grads<M: Module>(module: &M, grads: &Gradients) -> Vec<Tensor<1>> {
    collect(module, Some(grads))
}

fn collect<M: Module>(module: &M, grads: Option<&Gradients>) -> Vec<Tensor<1>> {
    struct Collect<'a>(Vec<Tensor<1>>, Option<&'a Gradients>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            let t = match self.1 {
                Some(grads) => value.grad(grads).expect("a parameter has no gradient"),
                None => value,
            };
            self.0.push(t.flatten(0, D - 1));
        }
    }
    let mut c = Collect(Vec::new(), grads);
    module.visit(&mut c);
    c.0
}
