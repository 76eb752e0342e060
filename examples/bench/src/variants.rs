//! `mha`'s attention core between input projections made another way than the module's
//! (`--variants`), timed beside the module at the same shape: what the projections cost
//! around the core, measured in the run that times the module.
//!
//! `MultiHeadAttention` keeps PyTorch's packed input weight `[d_model, 3·d_model]` and
//! multiplies by each third of it (a strided view) in turn. The two compositions here use
//! `mha::scaled_dot_product_attention` as the module does, with
//! - `core+linear`: three `burn::nn::Linear` layers of their own (contiguous weights, as
//!   Burn's module has), three products;
//! - `core+qkv`: one `Linear` to `3·d_model` (the packed weight whole), one product,
//!   the queries, keys and values as views of its output;
//!
//! and the core alone on inputs laid out as the module's projections give them
//! (`core-bthd`: the heads of `[B, T, H·Dh]` tensors, `[B, T, H, Dh]` in memory), beside
//! the core alone on contiguous `[B, H, T, Dh]` inputs (`mha-core`): what the layout
//! costs the kernels, apart from any projection.

use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, FloatDType, Tensor};
use mha::{AttentionMask, ModuleDType, SdpaOptions};

use crate::{Record, Shape, backward_of, find, grads_of, randn_as, time};

/// The input projections of a composition.
enum Projections {
    /// Queries, keys and values each through a layer of its own.
    Separate(Box<[Linear; 3]>),
    /// One layer to all three, its output cut in three.
    Packed(Linear),
}

/// Causal self-attention through `mha`'s core between `projections` and `out`.
struct Composed {
    projections: Projections,
    out: Linear,
    heads: usize,
}

impl Composed {
    fn new(shape: Shape, packed: bool, dtype: FloatDType, device: &Device) -> Self {
        let d = shape.d_model;
        let linear = |d_out| LinearConfig::new(d, d_out).init(device).to_dtype(dtype);
        let projections = match packed {
            true => Projections::Packed(linear(3 * d)),
            false => Projections::Separate(Box::new([linear(d), linear(d), linear(d)])),
        };
        Self {
            projections,
            out: linear(d),
            heads: shape.heads,
        }
    }

    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let h = self.heads;
        let heads = |y: Tensor<3>| y.reshape([b, t, h, d / h]).swap_dims(1, 2);
        let [q, k, v] = match &self.projections {
            Projections::Separate(layers) => [0, 1, 2].map(|i| heads(layers[i].forward(x.clone()))),
            Projections::Packed(layer) => {
                let qkv = layer.forward(x);
                [0, 1, 2].map(|i| heads(qkv.clone().narrow(2, i * d, d)))
            }
        };
        let causal = AttentionMask::causal();
        let context =
            mha::scaled_dot_product_attention(q, k, v, &causal, SdpaOptions::default()).context;
        self.out.forward(context.swap_dims(1, 2).reshape([b, t, d]))
    }
}

/// Times both compositions and the core on the module's layout at `shape` in `dtype`,
/// forward and forward+backward, into `out` (subjects `core+linear`, `core+qkv` and
/// `core-bthd`).
pub fn bench_variants(
    runs: usize,
    backend: &'static str,
    device: &Device,
    at: (Shape, FloatDType),
    out: &mut Vec<Record>,
) {
    let (shape, dtype) = at;
    let ad = device.clone().autodiff();
    let [b, t, d] = [shape.batch, shape.seq, shape.d_model];
    let mut record = |subject, pass, timed, flops| {
        out.push(Record::attention(backend, at, subject, pass, timed, flops));
    };
    let fwd = shape.mha_flops();
    for (subject, packed) in [("core+linear", false), ("core+qkv", true)] {
        let model = Composed::new(shape, packed, dtype, device);
        let x = randn_as(dtype, [b, t, d], device);
        let timed = time(runs, device, || model.forward(x.clone()));
        record(subject, "forward", timed, fwd);
        let model = Composed::new(shape, packed, dtype, &ad);
        let x = randn_as(dtype, [b, t, d], &ad).require_grad();
        let timed = time(runs, device, || {
            backward_of(&x, model.forward(x.clone()).sum())
        });
        record(subject, "forward+backward", timed, 3.0 * fwd);
    }

    // The core on the heads of `[B, T, H·Dh]` tensors, as the module calls it.
    let h = shape.heads;
    let heads = |x: &Tensor<3>| x.clone().reshape([b, t, h, d / h]).swap_dims(1, 2);
    let causal = AttentionMask::causal();
    let core = |[q, k, v]: &[Tensor<3>; 3]| {
        let options = SdpaOptions::default();
        mha::scaled_dot_product_attention(heads(q), heads(k), heads(v), &causal, options).context
    };
    let qkv = [0; 3].map(|_| randn_as(dtype, [b, t, d], device));
    let flops = shape.core_flops();
    record(
        "core-bthd",
        "forward",
        time(runs, device, || core(&qkv)),
        flops,
    );
    let qkv = [0; 3].map(|_| randn_as(dtype, [b, t, d], &ad).require_grad());
    let timed = time(runs, device, || {
        let grads = core(&qkv).sum().backward();
        grads_of(qkv.each_ref(), &grads)
    });
    record("core-bthd", "forward+backward", timed, 3.0 * flops);
}

/// The compositions' lines beside the module's, at each shape of `records` that has them.
pub fn print_variants(backend: &str, dtype: &str, records: &[&Record]) {
    let of = |shape, subject, pass| find(records, shape, subject, pass).map(|r| r.ms(2));
    let mut shapes: Vec<&str> = Vec::new();
    for r in records.iter().filter(|r| r.subject == "core+qkv") {
        if let Some(s) = r.shape
            && !shapes.contains(&s.name)
        {
            shapes.push(s.name);
        }
    }
    if shapes.is_empty() {
        return;
    }
    println!(
        "\n## {backend}, {dtype}: the module against its core between other projections, median ms\n"
    );
    println!(
        "| shape | pass | mha module | core + 3 Linear | core + 1 Linear to Q, K, V | core alone | core alone on [B, T, H, Dh] |"
    );
    println!("|---|---|---|---|---|---|---|");
    let cell = |text: Option<String>| text.unwrap_or_else(|| "—".into());
    for shape in shapes {
        for pass in ["forward", "forward+backward"] {
            println!(
                "| {shape} | {pass} | {} | {} | {} | {} | {} |",
                cell(of(shape, "mha", pass)),
                cell(of(shape, "core+linear", pass)),
                cell(of(shape, "core+qkv", pass)),
                cell(of(shape, "mha-core", pass)),
                cell(of(shape, "core-bthd", pass)),
            );
        }
    }
}
