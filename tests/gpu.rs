//! The GPU kernels' launches and memory, on the wgpu device (Mesa's lavapipe where there
//! is no GPU), each measured in a process of its own: the launch observer and the memory
//! pool's report are process-wide, and the report never resets.
//!
//! The outer tests run the `#[ignore]`d inner ones in a child process of this binary.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};

use burn::cubecl::logging::{LaunchObservation, LaunchObserver};
use burn::tensor::{Device, DeviceKind, Distribution, Tensor};
use mha::{AttentionMask, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};

/// Which compiler the wgpu device's kernels (Burn's and `mha`'s) go through: WGSL in a
/// build without the `vulkan` feature (CI's), so that every wgpu test of this binary runs
/// the kernels through it. In a `vulkan` build, SPIR-V on a Vulkan driver with the
/// features CubeCL's SPIR-V compiler needs (lavapipe, NVIDIA's), WGSL on others (Metal,
/// DX12), which CubeCL falls back to.
#[test]
fn the_kernels_compile_to_spirv_exactly_in_a_vulkan_build() {
    let burn::backend::DispatchDevice::Cube(device) = Device::wgpu(DeviceKind::DefaultDevice)
        .as_dispatch()
        .clone()
    else {
        panic!("the wgpu device is not a CubeCL device");
    };
    let name = device.client().name();
    println!("the wgpu device runs {name}");
    match cfg!(feature = "vulkan") {
        true => assert!(matches!(name, "wgpu<spirv>" | "wgpu<wgsl>"), "{name}"),
        false => assert_eq!(name, "wgpu<wgsl>"),
    }
}

/// Runs the ignored test `name` of this binary in a process of its own and fails with its
/// output if it fails; returns its output.
fn in_own_process(name: &str) -> String {
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("the test binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "{name} failed in its own process");
    assert!(text.contains("1 passed"), "{name} did not run: {text}");
    text
}

/// Counts every kernel launched while installed, by name.
#[derive(Default)]
struct Launches(Mutex<BTreeMap<&'static str, usize>>);

impl LaunchObserver for Launches {
    fn launched(&self, kernel: &'static str) {
        *self.0.lock().unwrap().entry(kernel).or_default() += 1;
    }
}

fn wgpu() -> Device {
    Device::wgpu(DeviceKind::DefaultDevice)
}

/// A self-attention module of width 64 in 4 heads.
fn module(device: &Device) -> MultiHeadAttention {
    MultiHeadAttentionConfig::new(64, 4).init(device)
}

/// The launches of `pass`, by kernel, after one run of it to warm up (compilation and
/// autotuning launch kernels of their own).
fn launches(device: &Device, pass: impl Fn()) -> BTreeMap<&'static str, usize> {
    pass();
    device.sync().expect("sync");
    let counts = Arc::new(Launches::default());
    let watching = LaunchObservation::new(counts.clone());
    pass();
    device.sync().expect("sync");
    drop(watching);
    counts.0.lock().unwrap().clone()
}

/// How many launches of kernels whose name holds `part`.
fn of(counts: &BTreeMap<&'static str, usize>, part: &str) -> usize {
    counts
        .iter()
        .filter(|(name, _)| name.contains(part))
        .map(|(_, n)| n)
        .sum()
}

#[test]
fn a_module_launches_the_same_kernels_at_every_length() {
    in_own_process("gpu::launches_at_two_lengths");
}

#[test]
#[ignore = "run in a process of its own by a_module_launches_the_same_kernels_at_every_length"]
fn launches_at_two_lengths() {
    let device = wgpu().autodiff();
    let m = module(&device);
    let mut seen = Vec::new();
    for length in [96, 640] {
        let x = Tensor::<3>::random([2, length, 64], Distribution::Default, &device);
        let forward = || {
            let input = MhaInput::self_attn(x.clone()).mask(AttentionMask::causal());
            drop(m.forward(input).context.into_data());
        };
        let backward = || {
            let x = x.clone().require_grad();
            let input = MhaInput::self_attn(x.clone()).mask(AttentionMask::causal());
            let grads = m.forward(input).context.sum().backward();
            drop(x.grad(&grads).expect("a gradient").into_data());
        };
        let (f, fb) = (launches(&device, forward), launches(&device, backward));
        for (what, counts) in [("forward", &f), ("forward and backward", &fb)] {
            let total: usize = counts.values().sum();
            println!("length {length}, {what}: {total} launches");
            for (name, n) in counts {
                // The kernel's own name, without its path and type parameters.
                let short = name.split('<').next().unwrap_or(name);
                println!("  {n} x {}", short.rsplit("::").next().unwrap_or(short));
            }
        }
        // One launch of each of our kernels, whatever the length: no chunk loop.
        assert_eq!(of(&f, "forward_kernel"), 1, "{f:?}");
        for kernel in ["forward_kernel", "delta_kernel", "dq_kernel", "dkv_kernel"] {
            assert_eq!(of(&fb, kernel), 1, "{kernel}: {fb:?}");
        }
        seen.push((f, fb));
    }
    // Burn's autotuning picks a matrix product (split or not, with its own reductions) per
    // shape, and may fill one buffer more or less: those launches may differ between the
    // lengths. Everything else is the same kernels at 640 tokens as at 96, within that
    // slack; the explicit path's query chunks (5 at 640 tokens, 1 at 96) would add four
    // or more launches per extra chunk.
    let others = |i: usize| -> [usize; 2] {
        let (f, fb) = &seen[i];
        [f, fb].map(|counts| {
            counts
                .iter()
                .filter(|(name, _)| {
                    !name.contains("cubek_matmul") && !name.contains("cubek_reduce")
                })
                .map(|(_, n)| n)
                .sum()
        })
    };
    let (short, long) = (others(0), others(1));
    for pass in 0..2 {
        assert!(
            long[pass] <= short[pass] + 2,
            "launches besides Burn's matrix products: {short:?} at 96 tokens, {long:?} at 640: {seen:?}"
        );
    }
}

#[test]
fn forward_and_backward_allocate_no_score_matrix() {
    in_own_process("gpu::largest_allocation_at_a_long_length");
}

#[test]
#[ignore = "run in a process of its own by forward_and_backward_allocate_no_score_matrix"]
fn largest_allocation_at_a_long_length() {
    let device = wgpu().autodiff();
    let m = module(&device);
    // [1, 4, 1024, 1024] scores in f32 would be 16 MiB; every activation is [1024, 64]
    // (256 KiB) or [1, 4, 1024, 16], the weights 64 x 64.
    let (batch, heads, length) = (1, 4, 1024);
    let scores = (batch * heads * length * length * 4) as u64;
    let x = Tensor::<3>::random([batch, length, 64], Distribution::Default, &device).require_grad();
    // No mask: every query sees every key, so nothing would be skipped or chunked.
    let grads = m
        .forward(MhaInput::self_attn(x.clone()))
        .context
        .sum()
        .backward();
    drop(x.grad(&grads).expect("a gradient").into_data());
    device.sync().expect("sync");
    let report = device.memory_pool_report().expect("wgpu reports its pools");
    let largest = report
        .iter()
        .map(|pool| pool.largest_alloc)
        .max()
        .unwrap_or(0);
    let usage = device.memory_pool_usage().expect("wgpu reports its usage");
    println!("largest allocation {largest} bytes, a score matrix {scores} bytes; {usage:?}");
    assert!(
        largest < scores / 4,
        "an allocation of {largest} bytes: a score matrix is {scores}"
    );
}

/// Forward and backward through the kernels twice, GQA 4:2 with a bias whose gradient is
/// asked for and a learned table: the same bits every time (no atomics, sums in a fixed
/// order).
#[test]
fn the_kernels_give_the_same_bits_every_run() {
    use burn::tensor::TensorData;
    use mha::{Buckets, PositionBias, SdpaOptions, scaled_dot_product_attention};

    let _turn = crate::util::gpu_turn();
    let device = wgpu().autodiff();
    let run = || {
        device.seed(7);
        let leaf = |dims: [usize; 4]| {
            Tensor::<4>::random(dims, Distribution::Default, &device).require_grad()
        };
        let (q, k, v) = (
            leaf([2, 4, 70, 32]),
            leaf([2, 2, 90, 32]),
            leaf([2, 2, 90, 32]),
        );
        let bias = leaf([1, 4, 1, 90]);
        let table = Tensor::<2>::random([4, 7], Distribution::Default, &device).require_grad();
        let buckets = Buckets::Clipped { max: 3 };
        let mask = AttentionMask::causal()
            .and(AttentionMask::bias(bias.clone()))
            .and(AttentionMask::position_bias(PositionBias::Learned {
                table: table.clone(),
                buckets,
            }));
        let out = scaled_dot_product_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            &mask,
            SdpaOptions::default(),
        );
        let grads = (out.context.clone() * out.context.clone()).sum().backward();
        let mut bits: Vec<TensorData> = vec![out.context.into_data()];
        for x in [q, k, v, bias] {
            bits.push(x.grad(&grads).expect("a gradient").into_data());
        }
        bits.push(
            table
                .grad(&grads)
                .expect("the table's gradient")
                .into_data(),
        );
        bits
    };
    let (first, second) = (run(), run());
    for (n, (a, b)) in first.iter().zip(&second).enumerate() {
        assert_eq!(
            a.as_bytes(),
            b.as_bytes(),
            "tensor {n} differs between runs"
        );
    }
}

/// The shape of the budget below: causal self-attention over `[2, 128, 64]` in 4 heads.
const BUDGET_SHAPE: [usize; 4] = [2, 128, 64, 4];
/// What one forward+backward of mha's module may cost at [`BUDGET_SHAPE`] on wgpu after
/// a warm-up: kernel launches (21 on lavapipe, 2026-11-28: forward one product by the
/// whole packed input weight, our kernel on views of its output and the output
/// projection, with their biases' additions; backward our three kernels, which write the
/// three gradients side by side into one tensor, and Burn's gradients of the two
/// projections; 47 when each third of the packed weight was a product of its own), and
/// the memory pool's peak in a process of its own (10 MiB, the pool's pages: 8 with the
/// thirds' products, one page more with the packed `[B, T, 3·D]` tensors, the
/// projection's output kept for the backward pass and its gradient). Burn's own module at
/// the same shape, measured beside it by the same test: 53 to 55 launches, 12 MiB.
const BUDGET_LAUNCHES: usize = 21;
const BUDGET_PEAK_MIB: f64 = 10.0;

/// The launches and the pool's peak of one forward+backward of `pass`, in this process.
fn costs(device: &Device, pass: impl Fn()) -> (usize, f64) {
    let counts = launches(device, pass);
    let peak: u64 = device
        .memory_pool_report()
        .expect("wgpu reports its pools")
        .iter()
        .map(|pool| pool.pages_peak * pool.page_size)
        .sum();
    (counts.values().sum(), peak as f64 / (1 << 20) as f64)
}

/// The costs an inner test printed: `costs: launches L, peak P MiB`.
fn printed_costs(name: &str) -> (usize, f64) {
    let text = in_own_process(name);
    let line = text
        .lines()
        .find_map(|l| l.split_once("costs: launches ").map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("{name} printed no costs: {text}"));
    let (launches, rest) = line.split_once(", peak ").expect("costs' format");
    let peak = rest.trim_end_matches(" MiB");
    (
        launches.parse().expect("a count"),
        peak.parse().expect("MiB"),
    )
}

#[test]
fn a_module_forward_and_backward_stays_within_its_budget() {
    let mine = printed_costs("gpu::mha_module_costs");
    let burn = printed_costs("gpu::burn_module_costs");
    println!(
        "one forward+backward at {BUDGET_SHAPE:?}: mha {} launches, peak {:.2} MiB; Burn's module {} launches, peak {:.2} MiB",
        mine.0, mine.1, burn.0, burn.1
    );
    assert!(
        mine.0 <= BUDGET_LAUNCHES && mine.1 <= BUDGET_PEAK_MIB,
        "mha: {mine:?}, over the budget of {BUDGET_LAUNCHES} launches and {BUDGET_PEAK_MIB} MiB (Burn's module: {burn:?})"
    );
}

#[test]
#[ignore = "run in a process of its own by a_module_forward_and_backward_stays_within_its_budget"]
fn mha_module_costs() {
    let device = wgpu().autodiff();
    let [b, t, d, h] = BUDGET_SHAPE;
    let m = MultiHeadAttentionConfig::new(d, h).init(&device);
    let x = Tensor::<3>::random([b, t, d], Distribution::Default, &device).require_grad();
    let (launches, peak) = costs(&device, || {
        let grads = m
            .forward(MhaInput::causal(x.clone()))
            .context
            .sum()
            .backward();
        drop(x.grad(&grads).expect("a gradient"));
    });
    println!("costs: launches {launches}, peak {peak:.3} MiB");
}

#[test]
#[ignore = "run in a process of its own by a_module_forward_and_backward_stays_within_its_budget"]
fn burn_module_costs() {
    use burn::nn::attention::{
        MhaInput as BurnInput, MultiHeadAttentionConfig as BurnConfig, generate_autoregressive_mask,
    };
    let device = wgpu().autodiff();
    let [b, t, d, h] = BUDGET_SHAPE;
    let m = BurnConfig::new(d, h).with_dropout(0.0).init(&device);
    let x = Tensor::<3>::random([b, t, d], Distribution::Default, &device).require_grad();
    let mask = generate_autoregressive_mask(b, t, &device);
    let (launches, peak) = costs(&device, || {
        let input = BurnInput::self_attn(x.clone()).mask_attn(mask.clone());
        let grads = m.forward(input).context.sum().backward();
        drop(x.grad(&grads).expect("a gradient"));
    });
    println!("costs: launches {launches}, peak {peak:.3} MiB");
}

/// Self-attention on the GPU kernels takes the packed input projection's output whole
/// (one product; the kernels read the query, key and value as views of it, and give one
/// gradient for the three), where the same module called with the input as separate query,
/// key and value (`MhaInput::new(x, x, x)`) takes three products of the weight's thirds:
/// the same outputs and gradients (of the input, both projections and the sinks), with
/// GQA, attention sinks and a causal mask with padding, each forward with two products in
/// place of four: at a width whose thirds are views and whose gradients the kernels write
/// in place (64 per head; at a batch of 1 too, with nothing copied), and at one whose
/// thirds start off the device's alignment for
/// bindings (7 per head): Burn's slice copies them, and the gradients are written apart,
/// then side by side.
#[test]
fn packed_self_attention_matches_separate_inputs() {
    in_own_process("gpu::packed_and_separate_inputs");
}

#[test]
#[ignore = "run in a process of its own by packed_self_attention_matches_separate_inputs"]
fn packed_and_separate_inputs() {
    use burn::tensor::{Bool, TensorData};
    use mha::mha::InputProjection;

    let device = wgpu().autodiff();
    let burn::backend::DispatchDevice::Cube(cube) = wgpu().as_dispatch().clone() else {
        panic!("the wgpu device is not a CubeCL device");
    };
    // The key's and value's columns start at 1024 and 1536 bytes, then 84 and 112.
    let alignment = cube.client().properties().memory.alignment;
    println!("the device's binding alignment: {alignment} bytes");
    assert!(
        (8..=512).contains(&alignment),
        "the cases below are in place and concatenated at alignments of 8 to 512 bytes, not {alignment}"
    );
    for (d, heads, kv_heads) in [(256, 4, 2), (21, 3, 1)] {
        let m = MultiHeadAttentionConfig::new(d, heads)
            .with_n_kv_heads(Some(kv_heads))
            .with_sinks(true)
            .init(&device);
        let (batch, len) = (2, 70);
        let x = Tensor::<3>::random([batch, len, d], Distribution::Default, &device).require_grad();
        // The last 29 keys of the second row are padding.
        let padding: Vec<bool> = (0..batch)
            .flat_map(|b| (0..len).map(move |j| b == 1 && j >= 41))
            .collect();
        let padding = Tensor::<2, Bool>::from_data(TensorData::new(padding, [batch, len]), &device);
        let mask = AttentionMask::causal().and(AttentionMask::key_padding(padding));
        let packed = || MhaInput::self_attn(x.clone()).mask(mask.clone());
        let separate = || MhaInput::new(x.clone(), x.clone(), x.clone()).mask(mask.clone());

        let products = |input: &dyn Fn() -> MhaInput| {
            let counts = launches(&device, || drop(m.forward(input()).context));
            of(&counts, "matmul")
        };
        assert_eq!(
            (products(&packed), products(&separate)),
            (2, 4),
            "d {d}: the products of a packed and a separate forward"
        );
        if d == 256 {
            // A batch of 1 too: the heads are views of the packed tensor, none copied.
            let x1 = Tensor::<3>::random([1, len, d], Distribution::Default, &device);
            let input = || MhaInput::self_attn(x1.clone()).mask(AttentionMask::causal());
            let counts = launches(&device, || drop(m.forward(input()).context));
            let copies = of(&counts, "copy") + of(&counts, "slice");
            assert_eq!(
                (of(&counts, "matmul"), copies),
                (2, 0),
                "d {d}, batch 1: the products and copies of a packed forward: {counts:?}"
            );
        }

        let run = |input: MhaInput| {
            let out = m.forward(input).context;
            let grads = out.clone().sum().backward();
            let InputProjection::Packed(proj) = &m.in_proj else {
                panic!("a packed projection")
            };
            let sinks = m.sinks.as_ref().expect("sinks");
            let bias = |l: &burn::nn::Linear| l.bias.as_ref().expect("a bias").grad(&grads);
            let flat = crate::util::to_vec::<1>;
            let grads = [
                flat(x.grad(&grads).expect("x").flatten(0, 2)),
                flat(proj.weight.grad(&grads).expect("in weight").flatten(0, 1)),
                flat(bias(proj).expect("in bias")),
                flat(
                    m.out_proj
                        .weight
                        .grad(&grads)
                        .expect("out weight")
                        .flatten(0, 1),
                ),
                flat(sinks.grad(&grads).expect("sinks")),
            ];
            (flat(out.inner().flatten(0, 2)), grads)
        };
        let (out_p, grads_p) = run(packed());
        let (out_s, grads_s) = run(separate());
        let names = ["x", "in weight", "in bias", "out weight", "sinks"];
        let pairs = std::iter::once(("output", &out_p, &out_s)).chain(
            names
                .iter()
                .zip(grads_p.iter().zip(&grads_s))
                .map(|(n, (p, s))| (*n, p, s)),
        );
        for (what, p, s) in pairs {
            assert_eq!(p.len(), s.len(), "d {d}: {what}");
            // Finite first: the largest differences below would pass over a NaN.
            assert!(
                p.iter().chain(s).all(|v| v.is_finite()),
                "d {d}: {what} not finite"
            );
            let scale = s.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            let worst = p
                .iter()
                .zip(s)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!("d {d}: {what}: largest difference {worst:.1e} (largest value {scale:.1e})");
            assert!(
                worst <= 1e-5 + 1e-4 * scale,
                "d {d}: {what}: packed and separate differ by {worst} (largest value {scale})"
            );
        }
    }
}
