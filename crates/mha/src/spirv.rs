//! The GPU kernels as SPIR-V, compiled without a device: what the `vulkan` build hands a
//! Vulkan driver, for a validator (`spirv-val`, the tests' check) or a report of a
//! driver's bug.
//!
//! ```no_run
//! let target = mha::spirv::Target::default();
//! for module in mha::spirv::kernels(&target).expect("the kernels compile") {
//!     std::fs::write(format!("{}.spv", module.name), module.bytes()).unwrap();
//! }
//! ```
//!
//! Every module is compiled as cubecl's wgpu runtime compiles it for a Vulkan device
//! whose features [`Target`] describes: the Vulkan memory model and buffer device
//! addresses (every module needs both; cubecl falls back to WGSL on a device without
//! them), the SPIR-V version, where the buffers' addresses are passed, how shared memory
//! is declared.

use burn::tensor::DType;

/// One compiled kernel.
#[derive(Clone, Debug)]
pub struct Module {
    /// Which kernel, in which variant (dtype, head dim, inputs, checked or not).
    pub name: String,
    /// The module's SPIR-V words.
    pub words: Vec<u32>,
}

impl Module {
    /// The module as a `.spv` file holds it (little-endian words).
    pub fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

/// The Vulkan device the kernels are compiled for, as far as the compiler reads it.
#[derive(Clone, Debug)]
pub struct Target {
    /// The highest SPIR-V version the device takes (`(1, 6)` for Vulkan 1.3).
    pub spirv_version: (u8, u8),
    /// The device's `maxPushConstantsSize`: the buffers' addresses go in push constants
    /// where they fit, else in a uniform buffer.
    pub push_constant_size: usize,
    /// Whether the device has `VK_KHR_workgroup_memory_explicit_layout` (shared memory
    /// declared as blocks).
    pub explicit_shared_memory: bool,
    /// The subgroup size.
    pub subgroup_size: u32,
    /// The float dtypes to compile the kernels for (`F32`, `F16`, `BF16`).
    pub dtypes: Vec<DType>,
    /// The shape `[m, n, k]` of the device's cooperative matrices
    /// (`VK_KHR_cooperative_matrix`, subgroup scope) with f16 and bf16 inputs and f32
    /// sums, if it has them (NVIDIA's drivers: `[16, 16, 16]`): the half dtypes' kernels
    /// are compiled on them too, as the launcher picks them on such a device.
    pub cooperative_matrix: Option<[u32; 3]>,
}

impl Default for Target {
    /// A Vulkan 1.3 device with 128 bytes of push constants, no explicit shared memory
    /// layout, subgroups of 32, no cooperative matrices, f32 and f16.
    fn default() -> Self {
        Self {
            spirv_version: (1, 6),
            push_constant_size: 128,
            explicit_shared_memory: false,
            subgroup_size: 32,
            dtypes: vec![DType::F32, DType::F16],
            cooperative_matrix: None,
        }
    }
}

/// Every kernel the GPU path launches, in the variants that change its code (each dtype
/// of `target`; head dims of 64 read four elements at a time and odd ones read one at a
/// time; with no optional input and with all of them, the soft cap, a bias's gradient;
/// checked as debug builds launch them and unchecked as release builds do), compiled to
/// SPIR-V for `target`.
///
/// # Errors
/// A kernel that does not expand or compile, named with the compiler's message; a dtype
/// other than `F32`, `F16` and `BF16`.
pub fn kernels(target: &Target) -> Result<Vec<Module>, String> {
    if let Some(dtype) = target
        .dtypes
        .iter()
        .find(|d| !matches!(d, DType::F32 | DType::F16 | DType::BF16))
    {
        return Err(format!(
            "spirv::kernels: dtype {dtype:?} is none of F32, F16 and BF16"
        ));
    }
    crate::gpu::spirv::kernels(target)
}

/// The smallest kernel that declares shared memory (each of 32 units writes one element
/// of a shared array and reads its neighbour's), compiled for `target`: the case that
/// shows how cubecl compiles shared memory, for a validator or a bug report.
///
/// cubecl 0.11.3 declares shared memory in one of two ways. On a device with
/// `VK_KHR_workgroup_memory_explicit_layout` ([`Target::explicit_shared_memory`]; NVIDIA's
/// drivers have it) each array is a `Workgroup` block, valid SPIR-V. Without it (Mesa's
/// lavapipe, 22.3 and 25.0) each array becomes a `Workgroup` variable whose type is a
/// *pointer* to the array (`lower_shared_implicit` in cubecl-spirv's `ops/memory.rs`
/// passes the variable the pointer type and its address the array type), so every
/// access to it is an `OpInBoundsAccessChain` that indexes a pointer: invalid SPIR-V,
/// which `spirv-val` and the Khronos validation layer reject, and on which lavapipe's
/// pipeline compiler crashes. Every kernel with shared memory (these kernels, Burn's
/// matrix product) has it there; kernels without (an element-wise one) are valid.
///
/// # Errors
/// As [`kernels`].
pub fn shared_memory_case(target: &Target) -> Result<Module, String> {
    crate::gpu::spirv::shared_memory_case(target)
}
