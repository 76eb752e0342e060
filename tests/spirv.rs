//! The GPU kernels' SPIR-V, as the `vulkan` build hands it to a Vulkan driver: every
//! kernel in every variant that changes its code, compiled without a device
//! (`mha::spirv`) for the device features that change the module, and checked by
//! SPIRV-Tools' validator for Vulkan 1.3 (built from the `spirv-tools` crate's sources,
//! which know the extensions cubecl uses, unlike Debian 12's `spirv-val`).
//!
//! With `MHA_SPIRV_DIR` set, every module is also written there as `<target>/<name>.spv`,
//! for `spirv-dis`, `spirv-val` or a driver's bug report.

use burn::tensor::DType;
use mha::spirv::{Module, Target, kernels, shared_memory_case};
use spirv_tools::TargetEnv;
use spirv_tools::val::{Validator, ValidatorOptions};

/// What the validator says of cubecl 0.11.3's shared memory on a device without an
/// explicit workgroup layout (see `mha::spirv::shared_memory_case`).
const SHARED_AS_POINTER: &str =
    "OpInBoundsAccessChain reached non-composite type while indexes still remain to be traversed";

/// `OpCooperativeMatrixMulAddKHR`'s opcode (`SPV_KHR_cooperative_matrix`).
const COOPERATIVE_MUL_ADD: u32 = 4459;

/// Devices with an explicit workgroup layout (NVIDIA's), with the other features that
/// change a module: the buffers' addresses in push constants or in a uniform buffer,
/// subgroups of 32 or 8, cooperative matrices of 16 x 16 x 16 (NVIDIA's) or 8 x 8 x 8
/// (Mesa's lavapipe since it has them) or none; f32, f16 and bf16.
fn explicit_targets() -> Vec<(&'static str, Target)> {
    let base = Target {
        explicit_shared_memory: true,
        dtypes: vec![DType::F32, DType::F16, DType::BF16],
        ..Target::default()
    };
    vec![
        ("explicit-push-constants", base.clone()),
        (
            "explicit-uniform",
            Target {
                push_constant_size: 0,
                subgroup_size: 8,
                ..base.clone()
            },
        ),
        (
            "explicit-cooperative-16",
            Target {
                cooperative_matrix: Some([16, 16, 16]),
                ..base.clone()
            },
        ),
        (
            "explicit-cooperative-8",
            Target {
                cooperative_matrix: Some([8, 8, 8]),
                subgroup_size: 8,
                push_constant_size: 0,
                ..base
            },
        ),
    ]
}

/// The opcodes of `module`'s instructions.
fn opcodes(module: &Module) -> impl Iterator<Item = u32> + '_ {
    let words = &module.words;
    let mut at = 5; // past the header
    std::iter::from_fn(move || {
        let word = *words.get(at)?;
        at += ((word >> 16) as usize).max(1);
        Some(word & 0xFFFF)
    })
}

/// The validator's complaint about `module`, if any; the module written to
/// `MHA_SPIRV_DIR/<target>/` when that is set.
fn validate(target: &str, module: &Module) -> Option<String> {
    if let Some(dir) = std::env::var_os("MHA_SPIRV_DIR") {
        let dir = std::path::Path::new(&dir).join(target);
        std::fs::create_dir_all(&dir).expect("MHA_SPIRV_DIR is writable");
        std::fs::write(dir.join(format!("{}.spv", module.name)), module.bytes())
            .expect("MHA_SPIRV_DIR is writable");
    }
    // Vulkan 1.3's own block layout rules: cubecl's wgpu runtime enables no other.
    spirv_tools::val::create(Some(TargetEnv::Vulkan_1_3))
        .validate(&module.words, Some(ValidatorOptions::default()))
        .err()
        .map(|e| e.to_string())
}

#[test]
fn every_kernel_compiles_to_valid_spirv_on_a_device_with_explicit_shared_memory() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, target) in explicit_targets() {
        let modules = kernels(&target).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Forward, dQ and dK/dV: 2 head dims x 2 sets of inputs x checked or not; the
        // decoding kernel, writing a row's output or a split's, at the same 8; then the
        // splits' combination, D and the reduction, per dtype; the zeros. With
        // cooperative matrices, the three kernels on them too, at head dim 64, for f16
        // and bf16.
        let halves = target.dtypes.iter().filter(|d| **d != DType::F32).count();
        let cooperative = match target.cooperative_matrix {
            Some(_) => halves * 3 * 4,
            None => 0,
        };
        assert_eq!(
            modules.len(),
            target.dtypes.len() * (3 * 8 + 2 * 8 + 3) + 1 + cooperative,
            "{name}"
        );
        for module in &modules {
            // The kernels on cooperative matrices, and only those, multiply on them.
            assert_eq!(
                module.name.contains("_cooperative_"),
                opcodes(module).any(|op| op == COOPERATIVE_MUL_ADD),
                "{name}/{}",
                module.name
            );
            if let Some(e) = validate(name, module) {
                failures.push(format!("{name}/{}: {e}", module.name));
            }
            checked += 1;
        }
    }
    println!("{checked} modules validated");
    assert!(
        failures.is_empty(),
        "{} of {checked} modules are invalid SPIR-V:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Without an explicit workgroup layout (Mesa's lavapipe), cubecl 0.11.3 declares shared
/// memory as a variable holding a pointer: the kernels that use it are invalid in that
/// one way and no other, and those that do not are valid. When a cubecl release fixes
/// it, this test fails: then the `vulkan` build may run the suite on lavapipe.
#[test]
fn without_explicit_shared_memory_only_shared_memory_is_invalid() {
    let target = Target {
        explicit_shared_memory: false,
        subgroup_size: 8,
        ..Target::default()
    };
    let case = shared_memory_case(&target).expect("compiles");
    let e = validate("implicit", &case).expect("cubecl 0.11.3's shared memory is invalid");
    assert!(e.contains(SHARED_AS_POINTER), "{e}");
    let explicit = Target {
        explicit_shared_memory: true,
        ..target.clone()
    };
    let case = shared_memory_case(&explicit).expect("compiles");
    assert_eq!(validate("explicit", &case), None);

    for module in kernels(&target).expect("compiles") {
        let shared = ["forward_", "dq_", "dkv_", "decode_"]
            .iter()
            .any(|k| module.name.starts_with(k));
        match (shared, validate("implicit", &module)) {
            (true, Some(e)) => assert!(e.contains(SHARED_AS_POINTER), "{}: {e}", module.name),
            (false, None) => {}
            (shared, e) => panic!("{} (shared memory: {shared}): {e:?}", module.name),
        }
    }
}
