//! Training on several devices with Burn's multi-device strategy: a step's shares give
//! the whole batch's gradient, and two devices train to the parameters one device reaches
//! with the whole batch. In a binary of their own, one test at a time ([`RANDOM`]): the
//! models are initialised from a device's seeded random numbers, which a test running
//! beside them in one process would draw from too.

use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use burn::train::{TrainOutput, TrainStep};

use train::backend::{Backend, Devices};
use train::batch::SeqBatcher;
use train::config::TrainConfig;
use train::model::ModelConfig;
use train::run_dir::{RunDir, load_model};
use train::tasks::{Example, Split, TaskConfig};
use train::training::{Status, train};

/// Held by each test while it seeds and draws from the devices' random numbers.
static RANDOM: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Every float parameter of `model`, in visiting order, as f32 values.
fn parameters<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Values(Vec<Vec<f32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data();
            self.0
                .push(data.convert::<f32>().try_to_vec().expect("f32 values"));
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    values.0
}

fn largest_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(a, b)| {
            assert_eq!(a.len(), b.len());
            a.iter().zip(b).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// Two handles of devices this machine offers for `backend`: two devices Burn lists
/// when it lists two; on wgpu over a software adapter (lavapipe), its default device
/// and its CPU device, which Burn opens as two devices (two queues, two memory
/// pools) on the one adapter; else (flex, ndarray, one GPU) the device twice.
fn two_devices(backend: Backend) -> Vec<Device> {
    if let Ok(two) = backend.devices(&Devices::Count(2)) {
        return two;
    }
    let one = backend.device().unwrap();
    #[cfg(feature = "wgpu")]
    if backend == Backend::Wgpu && backend.software_adapter(&one).is_some() {
        let cpu = Device::wgpu(burn::tensor::DeviceKind::Cpu);
        assert_ne!(one, cpu, "lavapipe's two devices are distinct");
        return vec![one, cpu];
    }
    vec![one.clone(), one]
}

/// The gradient of every parameter of `model` in `grads`, in visiting order.
fn gradients<M: Module>(model: &M, grads: &GradientsParams) -> Vec<Vec<f32>> {
    struct Grads<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad = self.0.get::<D>(param.id).expect("a gradient");
            let data = grad.into_data().convert::<f32>();
            self.1.push(data.try_to_vec().expect("f32 values"));
        }
    }
    let mut values = Grads(grads, Vec::new());
    model.visit(&mut values);
    values.1
}

/// A small run: reverse on inputs of one length (every share of a step counts as
/// many target tokens), two epochs of three steps (the second epoch's rows come from
/// the epoch counter the devices' loaders share), the global clip at a norm the first
/// steps' gradients exceed.
fn small_config(devices: usize) -> TrainConfig {
    TrainConfig {
        task: TaskConfig {
            min_len: 5,
            max_len: 5,
            n_symbols: 6,
            ..TaskConfig::default()
        },
        model: ModelConfig {
            d_model: 32,
            n_layers: 1,
            n_heads: 2,
            dropout: 0.0,
            ..Default::default()
        },
        batch_size: 8,
        lr: 1e-2,
        steps_per_epoch: 3,
        epochs: 2,
        valid_examples: 8,
        eval_examples: 4,
        clip_global: true,
        grad_clip: 0.5,
        devices: Devices::Count(devices),
        ..TrainConfig::default()
    }
}

#[test]
fn the_shares_of_a_step_give_the_whole_batch_gradient() {
    let _random = RANDOM.lock().unwrap_or_else(|e| e.into_inner());
    let config = small_config(1);
    let examples: Vec<Example> = (0..8)
        .map(|i| config.task.example(config.seed, Split::Train, i))
        .collect();
    for backend in Backend::compiled() {
        let device = backend.device().unwrap().autodiff();
        let model = config.init_model(&device).unwrap();
        let step = |examples: &[Example], shares| {
            let batcher = SeqBatcher {
                shares,
                ..SeqBatcher::default()
            };
            let output: TrainOutput<_> = model.step(batcher.batch(examples.to_vec(), &device));
            gradients(&model, &output.grads)
        };
        let whole = step(&examples, 1);
        let halves: Vec<Vec<Vec<f32>>> = examples.chunks(4).map(|s| step(s, 2)).collect();
        let summed: Vec<Vec<f32>> = halves[0]
            .iter()
            .zip(&halves[1])
            .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x + y).collect())
            .collect();
        let largest = whole.iter().flatten().fold(0f32, |m, g| m.max(g.abs()));
        let difference = largest_difference(&whole, &summed);
        // The same sums in another order: f32 rounding, relative to the gradients. Shares
        // not weighted by 1/2 would be off by the largest gradient itself.
        assert!(
            largest > 1e-3,
            "{backend}: gradients too small to tell: {largest}"
        );
        assert!(
            difference <= 1e-5 * largest.max(1.0),
            "{backend}: the shares' gradients differ from the whole batch's by {difference} \
             (largest gradient {largest})"
        );
    }
}

#[test]
fn two_devices_train_to_the_parameters_of_one_with_the_whole_batch() {
    let _random = RANDOM.lock().unwrap_or_else(|e| e.into_inner());
    for backend in Backend::compiled() {
        let trained = |devices: Vec<Device>| {
            let config = small_config(devices.len());
            let dir = std::env::temp_dir().join(format!(
                "mha-train-devices-{}-{backend}-{}",
                std::process::id(),
                devices.len()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let run = RunDir(dir.clone());
            run.prepare_new(false).unwrap();
            run.write_config(&config).unwrap();
            let summary = train(&config, &run, 0, &devices, backend, 1000).unwrap();
            assert_eq!(summary.status, Status::Finished, "{backend}");
            assert_eq!(summary.steps_done, 6, "{backend}");
            // Read before the files go: the weights are read from them lazily.
            let model = load_model(&config, &run.model(), &devices[0]).unwrap();
            let values = parameters(&model);
            let _ = std::fs::remove_dir_all(&dir);
            values
        };
        let devices = two_devices(backend);
        let initial = {
            let config = small_config(1);
            parameters(&config.init_model(&devices[0]).unwrap())
        };
        let one = trained(vec![devices[0].clone()]);
        let two = trained(devices.clone());
        let moved = largest_difference(&initial, &one);
        let difference = largest_difference(&one, &two);
        // Six AdamW steps of lr 1e-2 (a warmup step, then the cosine decay) move the
        // weights by a few 1e-2. Two devices sum the same gradients in another order:
        // f32 rounding, about 1e-7 of them, which AdamW's division by the root of the
        // second moment can enlarge for a weight whose gradients are near zero (measured:
        // 2.6e-7 on flex, 4.5e-7 on wgpu). A step on other rows, clipped per device, or
        // reading weights not yet written (wgpu without the steps' waits: 1e-3 to 5e-3)
        // ends 1e-3 and more away.
        assert!(
            moved > 1e-2,
            "{backend}: training moved the weights by only {moved}"
        );
        assert!(
            difference < 1e-5,
            "{backend} on {devices:?}: two devices end {difference} away from one \
             (training moved the weights by {moved})"
        );
    }
}
