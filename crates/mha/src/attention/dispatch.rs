//! The path of one attention call without weights or dropout, chosen from the device's
//! backend (a type: Burn's `DispatchDevice`), whether it differentiates, the dtypes and
//! the sizes. The choices were measured; the README's benchmarks give the numbers.

use burn::backend::DispatchDevice;
use burn::tensor::{BoolStore, DType, Tensor};

use crate::mask::AttentionMask;

/// Smallest query chunk of the explicit path; it chunks from `2 * MIN_CHUNK` queries on.
const MIN_CHUNK: usize = 128;
/// Most chunks the explicit path cuts the queries into (longer sequences, longer chunks).
const MAX_CHUNKS: usize = 16;

/// How one attention call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Path {
    /// The recompute op in CPU tiles: flex and ndarray, every tensor f32 and the boolean
    /// mask stored as bytes, with autodiff or not.
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    Tiles,
    /// Matmul, mask, softmax, matmul, in query chunks of `chunk` rows (`chunk >= Tq`: one
    /// pass). Chunks from `2 * MIN_CHUNK` queries on when the mask blocks by position
    /// (causal, windows, packed sequences: a chunk skips the keys its rows cannot see) or
    /// the device does not differentiate (a chunk's scores are freed before the next one's
    /// exist; under autodiff every chunk's are kept for the backward pass, so chunking
    /// would only add launches).
    Explicit { chunk: usize },
}

/// A CPU backend with tiles, under a device (autodiff or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cpu {
    #[cfg(feature = "flex")]
    Flex,
    #[cfg(feature = "ndarray")]
    NdArray,
}

impl Cpu {
    /// The backend of `device`, if it is one with tiles compiled in.
    pub(crate) fn of(device: &DispatchDevice) -> Option<Self> {
        #[allow(unreachable_patterns)] // Which variants exist depends on Burn's features.
        match device {
            DispatchDevice::Autodiff(inner) => Self::of(inner),
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => Some(Cpu::Flex),
            #[cfg(feature = "ndarray")]
            DispatchDevice::NdArray(_) => Some(Cpu::NdArray),
            _ => None,
        }
    }

    /// Whether `x` is an f32 tensor on flex or ndarray (with autodiff or not): what the
    /// fused CPU operations (GELU, layer norm, cross-entropy) take.
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    pub(crate) fn runs_fused<const D: usize>(x: &Tensor<D>) -> bool {
        x.dtype() == DType::F32 && Self::of(x.device().as_dispatch()).is_some()
    }
}

/// What the choice depends on.
#[derive(Clone, Copy, Debug)]
struct Call {
    cpu: Option<Cpu>,
    autodiff: bool,
    /// Every float tensor is f32 and the boolean mask is stored as bytes.
    f32_bytes: bool,
    queries: usize,
    /// The mask blocks by position.
    by_position: bool,
}

impl Path {
    /// The path of attention over these inputs (`query` `[B, H, Tq, Dk]`).
    pub(super) fn of(
        query: &Tensor<4>,
        key: &Tensor<4>,
        value: &Tensor<4>,
        mask: &AttentionMask,
    ) -> Self {
        let device = query.device();
        let floats = [query, key, value].into_iter().chain(mask.additive_bias());
        let bool_bytes = mask.blocked().is_none_or(|blocked| {
            matches!(
                blocked.dtype(),
                DType::Bool(BoolStore::Native | BoolStore::U8)
            )
        });
        Self::choose(Call {
            cpu: Cpu::of(device.as_dispatch()),
            autodiff: device.is_autodiff(),
            f32_bytes: bool_bytes && floats.into_iter().all(|t| t.dtype() == DType::F32),
            queries: query.dims()[2],
            by_position: !mask.rule().is_none(),
        })
    }

    fn choose(call: Call) -> Self {
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        if call.cpu.is_some() && call.f32_bytes {
            return Path::Tiles;
        }
        let long = call.queries >= 2 * MIN_CHUNK;
        let chunk = match long && (call.by_position || !call.autodiff) {
            true => MIN_CHUNK.max(call.queries.div_ceil(MAX_CHUNKS)),
            false => call.queries,
        };
        Path::Explicit { chunk }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn call(cpu: Option<Cpu>, autodiff: bool, queries: usize, by_position: bool) -> Call {
        Call {
            cpu,
            autodiff,
            f32_bytes: true,
            queries,
            by_position,
        }
    }

    #[test]
    fn the_explicit_path_chunks_long_causal_calls_and_long_calls_without_autodiff() {
        let whole = |queries| Path::Explicit { chunk: queries };
        for autodiff in [false, true] {
            for causal in [false, true] {
                // Short calls are one pass.
                assert_eq!(Path::choose(call(None, autodiff, 255, causal)), whole(255));
                let path = Path::choose(call(None, autodiff, 256, causal));
                match causal || !autodiff {
                    true => assert_eq!(path, Path::Explicit { chunk: 128 }),
                    false => assert_eq!(path, whole(256)),
                }
            }
        }
        // At most 16 chunks.
        let path = Path::choose(call(None, false, 4096, true));
        assert_eq!(path, Path::Explicit { chunk: 256 });
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_takes_the_tiles_in_f32_only() {
        use burn::tensor::{Distribution, FloatDType};
        for device in [Device::flex(), Device::flex().autodiff()] {
            assert_eq!(Cpu::of(device.as_dispatch()), Some(Cpu::Flex));
            let x = Tensor::<4>::random([1, 2, 300, 4], Distribution::Default, &device);
            let causal = AttentionMask::causal();
            assert_eq!(Path::of(&x, &x, &x, &causal), Path::Tiles);
            let x64 = x.clone().cast(FloatDType::F64);
            assert_eq!(
                Path::of(&x, &x64, &x, &causal),
                Path::Explicit { chunk: 128 }
            );
            let bias = AttentionMask::bias(x64.slice([0..1, 0..1, 0..300, 0..1]));
            let chunk = match device.is_autodiff() {
                true => 300,
                false => 128,
            };
            assert_eq!(Path::of(&x, &x, &x, &bias), Path::Explicit { chunk });
        }
    }

    #[cfg(feature = "ndarray")]
    #[allow(deprecated)] // Burn 0.22 deprecates ndarray; it is still one of our backends.
    #[test]
    fn ndarray_takes_the_tiles() {
        for device in [Device::ndarray(), Device::ndarray().autodiff()] {
            assert_eq!(Cpu::of(device.as_dispatch()), Some(Cpu::NdArray));
            let x = Tensor::<4>::zeros([1, 1, 3, 4], &device);
            let mask = AttentionMask::key_lengths(&[2], 3, &device);
            assert_eq!(Path::of(&x, &x, &x, &mask), Path::Tiles);
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_takes_the_explicit_path() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        for device in [device.clone(), device.autodiff()] {
            assert_eq!(Cpu::of(device.as_dispatch()), None);
            let x = Tensor::<4>::zeros([1, 1, 3, 4], &device);
            let path = Path::of(&x, &x, &x, &AttentionMask::causal());
            assert_eq!(path, Path::Explicit { chunk: 3 });
        }
    }
}
