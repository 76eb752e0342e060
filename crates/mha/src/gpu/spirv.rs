//! The kernels compiled to SPIR-V without a device, as a Vulkan driver receives them from
//! the `vulkan` build: for validators (`spirv-val`) and for reports of a driver's bugs.
//! The public side is [`crate::spirv`].

use std::sync::Arc;

use burn::tensor::DType;

use cubecl::prelude::*;
use cubecl::wgpu::SpirvCompiler;
use cubecl::{Compiler, WgpuCompilationOptions};

use super::backward::{BiasSums, delta_kernel, dkv_kernel, dq_kernel, reduce_kernel, zeros_kernel};
use super::backward::{DkvTiles, DqTiles};
use super::decode::{DecodeTiles, combine_kernel, decode_kernel};
use super::forward::ForwardTiles;
use super::forward::forward_kernel;
use super::launch::{decode_tiles, fragment, offline_device, tiles};
use super::scores::ProblemCompilationArg;
use super::tile::{Cooperative, Fragment, Registers, TileProduct};
use crate::problem::Dims;
use crate::spirv::{Module, Target};

/// A device as the compiler sees it: the limits the kernels' expansion reads.
fn device(target: &Target) -> Arc<DeviceProperties> {
    Arc::new(offline_device(
        target.subgroup_size,
        target.cooperative_matrix,
    ))
}

/// The compiler's options for `target`, as cubecl's wgpu runtime sets them from a Vulkan
/// device's features.
fn options(target: &Target) -> WgpuCompilationOptions {
    let mut options = WgpuCompilationOptions {
        supports_u64: true,
        supports_vulkan_compiler: true,
        ..Default::default()
    };
    options.vulkan.max_spirv_version = target.spirv_version;
    options.vulkan.max_vector_size = 4;
    options.vulkan.push_constant_size = target.push_constant_size;
    options.vulkan.supports_explicit_smem = target.explicit_shared_memory;
    options
}

/// A tensor argument as the compiler sees it.
fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// An optional tensor argument, present or absent.
fn optional<T: CubePrimitive>(present: bool) -> ComptimeOptionCompilationArg<OwnedTensor<T>> {
    match present {
        true => ComptimeOptionCompilationArg::Some(tensor()),
        false => ComptimeOptionCompilationArg::None,
    }
}

/// The launch argument every kernel reads, as the compiler sees it: with every optional
/// input (bias, bias by distance, mask, packed sequences) or with none.
fn problem<F: Float, M: Int, N: Size>(every_input: bool) -> ProblemCompilationArg<F, M, N> {
    ProblemCompilationArg {
        q: tensor(),
        k: tensor(),
        v: tensor(),
        bias: optional(every_input),
        pd: optional(every_input),
        mask: optional(every_input),
        seq: optional(every_input),
        offset: (),
        before: (),
        after: (),
        group: (),
        scale: (),
        softcap: (),
        blocked: (),
        order: (),
    }
}

/// Compiles `kernel` for `target` under `name`.
fn compile<K: CubeKernel>(kernel: K, name: String, target: &Target) -> Result<Module, String> {
    let definition = cubecl::define_kernel(&kernel).map_err(|e| format!("{name}: {e}"))?;
    let compiled = SpirvCompiler
        .compile(definition, &options(target))
        .map_err(|e| format!("{name}: {e}"))?;
    Ok(Module {
        name,
        words: compiled.assembled_module,
    })
}

/// The settings of a launch of `units` units per cube, checked or not.
fn settings(units: usize, checked: bool) -> KernelSettings {
    let mode = match checked {
        true => ExecutionMode::Checked,
        false => ExecutionMode::Unchecked,
    };
    KernelSettings::new(*CubeDim::new_1d(units as u32), mode, AddressType::U32)
}

/// The forward, dQ and dK/dV kernels over the tile product `P` in `tiles`, checked or
/// not, as modules named `{kernel}_{tag}`.
#[allow(clippy::too_many_arguments)]
fn attention<P: TileProduct>(
    target: &Target,
    props: &Arc<DeviceProperties>,
    (forward, dq, dkv): (ForwardTiles, DqTiles, DkvTiles),
    every_input: bool,
    width: usize,
    [elem, mask, weights]: [ElemType; 3],
    checked: bool,
    tag: &str,
) -> Result<Vec<Module>, String> {
    let runtime = || Arc::new(TargetProperties::default());
    Ok(vec![
        compile(
            forward_kernel::ForwardKernel::<P>::new(
                settings(forward.units, checked),
                props.clone(),
                runtime(),
                problem(every_input),
                tensor(),
                tensor(),
                width,
                forward,
                [elem, mask, weights],
            ),
            format!("forward_{tag}"),
            target,
        )?,
        compile(
            dq_kernel::DqKernel::<P>::new(
                settings(dq.units, checked),
                props.clone(),
                runtime(),
                problem(every_input),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                optional(every_input),
                optional(every_input),
                width,
                dq,
                [elem, mask, weights],
            ),
            format!("dq_{tag}"),
            target,
        )?,
        compile(
            dkv_kernel::DkvKernel::<P>::new(
                settings(dkv.units, checked),
                props.clone(),
                runtime(),
                problem(every_input),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                width,
                dkv,
                [elem, mask, weights],
            ),
            format!("dkv_{tag}"),
            target,
        )?,
    ])
}

/// The decoding kernel in the tiles a call of one query over `dims`' keys takes
/// (`launch::decode_tiles`), writing the row's output and writing a split's (with the soft
/// cap where `every_input` asks for every input), checked and not, as modules named
/// `decode_{tag}...`.
fn decode(
    target: &Target,
    props: &Arc<DeviceProperties>,
    dims: &Dims,
    every_input: bool,
    width: usize,
    [elem, mask]: [ElemType; 2],
    tag: &str,
) -> Result<Vec<Module>, String> {
    let f32_elem = ElemType::Float(cubecl::ir::FloatKind::F32);
    let one = Dims {
        queries: 1,
        ..*dims
    };
    let scoring = super::launch::Scoring {
        scale: 1.0,
        softcap: every_input.then_some(1.0),
        band: crate::mask::Band {
            offset: 0,
            before: None,
            after: None,
        },
    };
    let t = decode_tiles(&one, scoring);
    if t.shared_bytes() > 32 * 1024 {
        return Err(format!(
            "decode_{tag}: the decoding kernel takes no call of {one:?}"
        ));
    }
    let mut modules = Vec::new();
    for (split, w) in [(false, elem), (true, f32_elem)] {
        for checked in [true, false] {
            modules.push(compile(
                decode_kernel::DecodeKernel::new(
                    settings(t.units, checked),
                    props.clone(),
                    Arc::new(TargetProperties::default()),
                    problem(every_input),
                    tensor(),
                    tensor(),
                    width,
                    DecodeTiles { split, ..t },
                    [elem, mask, w],
                ),
                format!(
                    "decode_{tag}{}{}",
                    if split { "_split" } else { "" },
                    if checked { "_checked" } else { "" }
                ),
                target,
            )?);
        }
    }
    Ok(modules)
}

/// Every kernel the GPU path launches, in the variants a call can ask for, compiled for
/// `target`.
pub(crate) fn kernels(target: &Target) -> Result<Vec<Module>, String> {
    let mut modules = Vec::new();
    let f32_elem = ElemType::Float(cubecl::ir::FloatKind::F32);
    let float = |dtype: &DType| match dtype {
        DType::F16 => ("f16", 2, ElemType::Float(cubecl::ir::FloatKind::F16)),
        DType::BF16 => ("bf16", 2, ElemType::Float(cubecl::ir::FloatKind::BF16)),
        _ => ("f32", 4, f32_elem),
    };
    let u32_mask = ElemType::UInt(cubecl::ir::UIntKind::U32);
    let u8_mask = ElemType::UInt(cubecl::ir::UIntKind::U8);
    let props = device(target);
    let runtime = || Arc::new(TargetProperties::default());
    // Head dims of 64 (read four elements at a time) and odd ones (one at a time), in the
    // tiles the launcher picks for them (`launch::tiles`, within 32 KiB of shared
    // memory); with no optional input and with all of them (the soft cap and the bias
    // gradients' sums too); checked (debug builds) and unchecked (release builds). On a
    // target with cooperative matrices, the half dtypes' kernels on them too, in the
    // tiles the launcher picks for those (head dim 64 only: 7 is no whole fragment).
    for (dtype, size, elem) in target.dtypes.iter().map(float) {
        let frag = fragment(&props, elem).unwrap_or(Fragment::NONE);
        for (d, width) in [(64, 4), (7, 1)] {
            let dims = Dims::of([[2, 8, 256, d], [2, 2, 256, d], [2, 2, 256, d]]);
            for (every_input, mask) in [(false, u32_mask), (true, u8_mask)] {
                let with_sums = |(forward, mut dq, dkv): (ForwardTiles, DqTiles, DkvTiles)| {
                    if every_input {
                        dq.bias = BiasSums::Some {
                            queries: true,
                            keys: true,
                        };
                        dq.pd = true;
                    }
                    (forward, dq, dkv)
                };
                let portable =
                    with_sums(tiles(&dims, size, 32 * 1024, every_input, Fragment::NONE));
                modules.extend(decode(
                    target,
                    &props,
                    &dims,
                    every_input,
                    width,
                    [elem, mask],
                    &format!(
                        "{dtype}_d{d}_{}",
                        if every_input { "every_input" } else { "plain" }
                    ),
                )?);
                let shared = props.hardware.max_shared_memory_size;
                let fragments = with_sums(tiles(&dims, size, shared, every_input, frag));
                for checked in [true, false] {
                    let tag = format!(
                        "{dtype}_d{d}_{}{}",
                        if every_input { "every_input" } else { "plain" },
                        if checked { "_checked" } else { "" },
                    );
                    let dtypes = [elem, mask, f32_elem];
                    modules.extend(attention::<Registers>(
                        target,
                        &props,
                        portable,
                        every_input,
                        width,
                        dtypes,
                        checked,
                        &tag,
                    )?);
                    let (forward, dq, dkv) = fragments;
                    if forward.frag.is_some() && dq.frag.is_some() && dkv.frag.is_some() {
                        modules.extend(attention::<Cooperative>(
                            target,
                            &props,
                            fragments,
                            every_input,
                            width,
                            [elem, mask, elem],
                            checked,
                            &format!("cooperative_{tag}"),
                        )?);
                    }
                }
            }
        }
        modules.push(compile(
            delta_kernel::DeltaKernel::new(
                settings(64, true),
                props.clone(),
                runtime(),
                tensor(),
                tensor(),
                tensor(),
                64,
                elem,
            ),
            format!("delta_{dtype}"),
            target,
        )?);
        modules.push(compile(
            combine_kernel::CombineKernel::new(
                settings(256, true),
                props.clone(),
                runtime(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                elem,
            ),
            format!("combine_{dtype}"),
            target,
        )?);
        modules.push(compile(
            reduce_kernel::ReduceKernel::new(
                settings(64, true),
                props.clone(),
                runtime(),
                tensor(),
                tensor(),
                (),
                elem,
            ),
            format!("reduce_{dtype}"),
            target,
        )?);
    }
    modules.push(compile(
        zeros_kernel::ZerosKernel::new(settings(64, true), props, runtime(), tensor(), ()),
        "zeros".into(),
        target,
    )?);
    Ok(modules)
}

/// The smallest kernel with shared memory: each unit writes its position to an element
/// of a shared array and reads its neighbour's back.
#[cube(launch)]
fn shared_round_trip(out: &mut Tensor<f32>) {
    let mut shared = Shared::<[f32]>::new_slice(32usize);
    let unit = UNIT_POS as usize;
    shared[unit] = f32::cast_from(unit);
    sync_cube();
    out[unit] = shared[(unit + 1) % 32];
}

/// [`shared_round_trip`] compiled for `target`.
pub(crate) fn shared_memory_case(target: &Target) -> Result<Module, String> {
    compile(
        shared_round_trip::SharedRoundTrip::new(
            settings(32, false),
            device(target),
            Arc::new(TargetProperties::default()),
            tensor(),
        ),
        "shared_round_trip".into(),
        target,
    )
}
