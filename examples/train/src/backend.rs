//! The backends a build of the trainer has, and their devices.

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

/// A backend the trainer knows; the help lists those compiled into this build (asking
/// for another is an error naming the feature to build with).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// Burn's pure-Rust CPU backend.
    #[value(hide = !cfg!(feature = "flex"))]
    Flex,
    /// The ndarray CPU backend.
    #[value(hide = !cfg!(feature = "ndarray"))]
    Ndarray,
    /// wgpu: Vulkan, Metal or DX12 (lavapipe without a GPU).
    #[value(hide = !cfg!(feature = "wgpu"))]
    Wgpu,
    /// CUDA.
    #[value(hide = !cfg!(feature = "cuda"))]
    Cuda,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Backend {
    /// Those this build has, best first: a GPU if compiled in, then flex, then ndarray.
    pub fn compiled() -> Vec<Backend> {
        let all = [
            (Backend::Cuda, cfg!(feature = "cuda")),
            (Backend::Wgpu, cfg!(feature = "wgpu")),
            (Backend::Flex, cfg!(feature = "flex")),
            (Backend::Ndarray, cfg!(feature = "ndarray")),
        ];
        all.into_iter()
            .filter(|(_, on)| *on)
            .map(|(b, _)| b)
            .collect()
    }

    /// `backend`, or else the best one this build has.
    ///
    /// # Errors
    /// When the build has no backend at all.
    pub fn or_best(backend: Option<Backend>) -> anyhow::Result<Backend> {
        match backend.or_else(|| Backend::compiled().first().copied()) {
            Some(backend) => Ok(backend),
            None => anyhow::bail!(
                "this build has no backend: build with `--features flex` (or ndarray, wgpu, cuda)"
            ),
        }
    }

    /// Whether it runs on a GPU (where kernels are compiled per shape).
    pub fn is_gpu(self) -> bool {
        matches!(self, Backend::Wgpu | Backend::Cuda)
    }

    /// Its name, as on the command line and in the summary.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Ndarray => "ndarray",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
        }
    }

    /// Its device, or an error if this build does not have it.
    #[allow(deprecated, unreachable_code)]
    pub fn device(self) -> anyhow::Result<Device> {
        match self {
            #[cfg(feature = "flex")]
            Backend::Flex => return Ok(Device::flex()),
            #[cfg(feature = "ndarray")]
            Backend::Ndarray => return Ok(Device::ndarray()),
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => return Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            Backend::Cuda => return Ok(Device::cuda(0)),
            _ => {}
        }
        anyhow::bail!(
            "--backend {}: this build has {}; build with `--features {}`",
            self.name(),
            Backend::compiled()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>()
                .join(", "),
            self.name()
        )
    }

    /// The adapter's name when `device` is a GPU backend's device running on a software or
    /// CPU adapter (Mesa's lavapipe or llvmpipe, WARP, SwiftShader): no card behind it.
    pub fn software_adapter(self, device: &Device) -> Option<String> {
        if self != Backend::Wgpu {
            return None;
        }
        #[cfg(feature = "wgpu")]
        if let Some(identity) = device.as_dispatch().identity() {
            return identity.physical.is_none().then_some(identity.name);
        }
        let _ = device;
        None
    }
}
