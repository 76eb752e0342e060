//! The backends a build of the trainer has, and their devices.

use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::fields::DEVICES;

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
            Backend::Wgpu => return wgpu_device(),
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

    /// The devices a run of `devices` trains on, the first its main one (where the
    /// optimizer steps and the validation runs). One device is [`device`](Self::device)'s.
    /// Several: on a GPU backend, the devices Burn lists for it on this machine
    /// (`Device::enumerate`), by their place in that list; on flex and ndarray, which have
    /// one device (the CPU), that device as many times: as many workers, sharing its cores.
    ///
    /// # Errors
    /// When the build does not have the backend, and naming the backend and what it has
    /// when it lists fewer devices than asked for or an index past its list.
    pub fn devices(self, devices: &Devices) -> anyhow::Result<Vec<Device>> {
        let one = self.device()?;
        if *devices == Devices::Count(1) {
            return Ok(vec![one]);
        }
        let listed = match self.is_gpu() {
            true => self.listed(),
            false => vec![one.clone()],
        };
        let flag = DEVICES.flag.unwrap_or(DEVICES.path);
        let names = || match self.is_gpu() {
            true => {
                let names: Vec<String> = listed
                    .iter()
                    .enumerate()
                    .map(|(i, d)| format!("{i}: {}", device_name(d)))
                    .collect();
                format!(
                    "{} lists {} on this machine{}",
                    self.name(),
                    crate::text::plural(listed.len(), "device"),
                    match names.is_empty() {
                        true => String::new(),
                        false => format!(" ({})", names.join(", ")),
                    }
                )
            }
            false => format!(
                "{} has one device, the CPU (index 0), which several workers may share",
                self.name()
            ),
        };
        if let Devices::Count(n) = devices
            && self.is_gpu()
        {
            anyhow::ensure!(
                *n <= listed.len(),
                "{flag} {n}: {}; train on at most {}",
                names(),
                listed.len()
            );
        }
        if let Devices::List(list) = devices {
            for &i in list {
                anyhow::ensure!(
                    i < listed.len(),
                    "{flag} {devices}: no device {i}: {}",
                    names()
                );
            }
            if self.is_gpu() {
                let mut seen = list.clone();
                seen.sort_unstable();
                seen.dedup();
                anyhow::ensure!(
                    seen.len() == list.len(),
                    "{flag} {devices}: a device named twice; each GPU device trains once"
                );
            }
        }
        Ok(devices
            .indices()
            .into_iter()
            .map(|i| match self.is_gpu() {
                true => listed[i].clone(),
                false => one.clone(),
            })
            .collect())
    }

    /// The devices Burn lists for this GPU backend on this machine.
    #[allow(unreachable_code)]
    fn listed(self) -> Vec<Device> {
        match self {
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => {
                return Device::enumerate(burn::tensor::DeviceType::Wgpu).into_vec();
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda => {
                return Device::enumerate(burn::tensor::DeviceType::Cuda).into_vec();
            }
            _ => {}
        }
        Vec::new()
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

/// wgpu's default device, once it is known to have an adapter: without one (no GPU
/// driver, no software one) Burn panics at the device's first use, here turned into an
/// error naming what to do.
#[cfg(feature = "wgpu")]
fn wgpu_device() -> anyhow::Result<Device> {
    use std::sync::OnceLock;
    /// The probe's outcome, once per process: its panic's message, if it panicked.
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    let failed = PROBE.get_or_init(|| {
        // The probe's panic is the error below: the default hook's message silenced for
        // it (once, by one thread: others asking meanwhile wait for its outcome).
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let probe = std::panic::catch_unwind(|| device.supports_dtype(burn::tensor::DType::F32));
        std::panic::set_hook(hook);
        probe.err().map(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "no reason given".into())
        })
    });
    match failed {
        None => Ok(device),
        Some(why) => anyhow::bail!(
            "--backend wgpu: no GPU adapter can be opened ({why}): install the GPU's \
             Vulkan, Metal or DirectX driver (or Mesa's software one, lavapipe: \
             apt-get install mesa-vulkan-drivers), or choose --backend flex"
        ),
    }
}

/// A device as messages name it: its adapter's name on a GPU backend, else Burn's name
/// for it.
pub fn device_name(device: &Device) -> String {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(identity) = device.as_dispatch().identity() {
        return identity.name;
    }
    format!("{device:?}")
}

/// The devices a run trains on, as `config.json` and `--devices` give them: how many (the
/// first N the backend lists, a JSON number, `--devices 2`) or which (their places in
/// that list, a JSON array, `--devices 0,2`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// The first N.
    Count(usize),
    /// These, by their index in the backend's list.
    List(Vec<usize>),
}

impl Default for Devices {
    fn default() -> Self {
        Devices::Count(1)
    }
}

impl Devices {
    /// How many devices train.
    pub fn count(&self) -> usize {
        match self {
            Devices::Count(n) => *n,
            Devices::List(list) => list.len(),
        }
    }

    /// Their indices in the backend's list.
    pub fn indices(&self) -> Vec<usize> {
        match self {
            Devices::Count(n) => (0..*n).collect(),
            Devices::List(list) => list.clone(),
        }
    }
}

impl std::fmt::Display for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Devices::Count(n) => write!(f, "{n}"),
            Devices::List(list) => {
                let list: Vec<String> = list.iter().map(usize::to_string).collect();
                f.write_str(&list.join(","))
            }
        }
    }
}

impl std::str::FromStr for Devices {
    type Err = String;

    /// `2` (the first two devices) or `0,2` (devices 0 and 2).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let number = |part: &str| {
            part.trim().parse::<usize>().map_err(|_| {
                format!(
                    "`{}`: a number of devices (`2`) or their indices separated by commas \
                     (`0,2`)",
                    crate::text::echo(text)
                )
            })
        };
        match text.contains(',') {
            false => number(text).map(Devices::Count),
            true => text
                .split(',')
                .map(number)
                .collect::<Result<_, _>>()
                .map(Devices::List),
        }
    }
}

/// The GPU to one test at a time, while `backend` is a GPU's (held until dropped).
/// CubeCL's autotuner marks a kernel choice pending while one thread measures its
/// candidates, and another thread asking for that choice meanwhile runs the first
/// candidate instead of the winner, which rounds differently: two tests tuning the same
/// products at once could make a test's two paths take different kernels, and its exact
/// comparisons fail by chance. A seeded test's weights are drawn from the backend's one
/// generator too.
#[cfg(test)]
pub(crate) fn gpu_turn(backend: Backend) -> Option<std::sync::MutexGuard<'static, ()>> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    backend.is_gpu().then(|| {
        GPU.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::plural;

    #[test]
    fn devices_read_as_written_and_print_back() {
        assert_eq!("2".parse(), Ok(Devices::Count(2)));
        assert_eq!("0, 2".parse(), Ok(Devices::List(vec![0, 2])));
        assert!("two".parse::<Devices>().unwrap_err().contains("`two`"));
        assert!("0,x".parse::<Devices>().is_err());
        for devices in [Devices::Count(3), Devices::List(vec![1, 0])] {
            assert_eq!(devices.to_string().parse(), Ok(devices.clone()));
            let json = serde_json::to_string(&devices).unwrap();
            assert_eq!(serde_json::from_str::<Devices>(&json).unwrap(), devices);
        }
        assert_eq!(Devices::List(vec![2, 0]).indices(), [2, 0]);
        assert_eq!(Devices::Count(2).count(), 2);
    }

    #[test]
    fn devices_are_those_the_backend_has_or_refused_naming_it() {
        for backend in Backend::compiled() {
            let _turn = crate::backend::gpu_turn(backend);
            let one = backend.device().unwrap();
            assert_eq!(
                backend.devices(&Devices::Count(1)).unwrap(),
                std::slice::from_ref(&one)
            );
            if !backend.is_gpu() {
                // The one CPU device, as many times as asked.
                let three = backend.devices(&Devices::Count(3)).unwrap();
                assert_eq!(three, vec![one; 3], "{backend}");
                let err = backend.devices(&Devices::List(vec![0, 1])).unwrap_err();
                let err = err.to_string();
                assert!(err.contains("no device 1"), "{err}");
                assert!(err.contains(&format!("{backend} has one device")), "{err}");
                continue;
            }
            let listed = backend.listed();
            let err = backend.devices(&Devices::Count(listed.len() + 1));
            let err = err.unwrap_err().to_string();
            let lists = format!("{backend} lists {}", plural(listed.len(), "device"));
            assert!(err.contains(&lists), "{err}");
            if !listed.is_empty() {
                // By index, the list's devices (one device by count is the default one).
                let all = backend.devices(&Devices::List((0..listed.len()).collect()));
                assert_eq!(all.unwrap(), listed, "{backend}");
                let err = backend.devices(&Devices::List(vec![0, 0])).unwrap_err();
                assert!(err.to_string().contains("a device named twice"), "{err}");
            }
        }
    }
}
