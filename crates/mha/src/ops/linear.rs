//! The linear layers' products, `x W + b`. On the CPU backends they are one operation
//! with a backward of its own, both through `cpu::linear`'s direct calls of the `gemm`
//! crate; elsewhere Burn's `linear`. Burn's `nn::Linear` keeps its parameters and record:
//! only the computation is ours.

use core::iter::once_with;

use burn::nn::Linear;
use burn::tensor::Tensor;

use crate::dispatch::{self, RowCall, RowOp, RowPath};
use crate::empty::zero_of;

/// `linear`'s output for `x` `[.., d_in]`.
///
/// # Panics
/// If the last axis of `x` is not the layer's `d_input`, or the layer is of another dtype
/// (the message names both).
pub(crate) fn forward<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    let bias = linear.bias.as_ref().map(|b| b.val());
    columns(x, linear.weight.val(), bias, None)
}

/// The dtypes of `linear`'s weight and bias.
fn dtypes(linear: &Linear) -> Vec<burn::tensor::DType> {
    let bias = linear.bias.as_ref().map(|b| b.val().dtype());
    std::iter::once(linear.weight.val().dtype())
        .chain(bias)
        .collect()
}

/// `GELU(x W + b)` for `x` `[.., d_in]` (the exact GELU, as [`super::gelu::gelu`]). On
/// the CPU backends one operation: each thread's block of rows goes through GELU where
/// its product left it, and the backward pass multiplies the output's gradient by GELU's
/// derivative block by block before the products (`cpu::linear`). Elsewhere the layer,
/// then the GELU.
///
/// # Panics
/// If the last axis of `x` is not the layer's `d_input`, or the layer is of another dtype
/// (the message names both).
pub(crate) fn forward_gelu<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    let dtypes = dtypes(linear);
    if dtypes
        .iter()
        .any(|d| matches!(d, burn::tensor::DType::QFloat(_)))
    {
        // Quantized: the product dequantizes the layer (`columns`).
        return super::gelu::gelu(forward(linear, x));
    }
    super::check_dtypes("Linear", x.dtype(), dtypes);
    let no_output = linear.weight.val().dims()[1] == 0;
    match dispatch::row(RowCall::of(RowOp::LinearGelu, &x).empty_if(no_output)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let weight = linear.weight.val();
            let [d_in, d_out] = weight.dims();
            let mut dims = x.dims();
            assert!(
                dims[D - 1] == d_in,
                "Linear: the input's last axis is {} wide (shape {dims:?}), the layer's \
                 d_input is {d_in}",
                dims[D - 1],
            );
            dims[D - 1] = d_out;
            let bias = linear
                .bias
                .as_ref()
                .map(|b| b.val().reshape([1, 1, 1, d_out]));
            let floats = [super::rows(x), weight.reshape([1, 1, d_in, d_out])]
                .into_iter()
                .chain(bias)
                .collect();
            super::run(super::FusedOp::LinearGelu, floats, None).reshape(dims)
        }
        // Empty too: the layer's own empty case, then GELU's.
        RowPath::Burn | RowPath::BurnInF32 | RowPath::Empty => {
            super::gelu::gelu(forward(linear, x))
        }
    }
}

/// `x W[:, c] + b[c]` for the columns `c` in `start..start + len` of the weight `[d_in,
/// d_all]` and bias `[d_all]` (all of them when `columns` is `None`).
///
/// # Panics
/// If the last axis of `x` is not `d_in`, or the weight or bias is of another dtype than
/// `x` (the message names both).
pub(crate) fn columns<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    columns: Option<[usize; 2]>,
) -> Tensor<D> {
    let weight = crate::dtype::dequantized(weight, x.dtype());
    let bias = bias.map(|b| crate::dtype::dequantized(b, x.dtype()));
    let [d_in, d_all] = weight.dims();
    assert!(
        x.dims()[D - 1] == d_in,
        "Linear: the input's last axis is {} wide (shape {:?}), the layer's d_input is {d_in}",
        x.dims()[D - 1],
        x.dims()
    );
    // Narrowed only when asked: a slice, even of every column, records a step whose
    // backward writes the gradient into zeros of the whole.
    let columns = columns.filter(|&c| c != [0, d_all]);
    let others = [Some(weight.dtype()), bias.as_ref().map(Tensor::dtype)];
    super::check_dtypes("Linear", x.dtype(), others.into_iter().flatten());
    let width = columns.map_or(d_all, |[_, len]| len);
    match dispatch::row(RowCall::of(RowOp::Linear, &x).empty_if(width == 0)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let mut dims = x.dims();
            // The weight and bias reshaped whole (views) before their columns are taken
            // (a view too; the reshape of a column slice would copy it).
            let weight = weight.reshape([1, 1, d_in, d_all]);
            let bias = bias.map(|b| b.reshape([1, 1, 1, d_all]));
            let (weight, bias) = match columns {
                Some([start, len]) => (
                    weight.narrow(3, start, len),
                    bias.map(|b| b.narrow(3, start, len)),
                ),
                None => (weight, bias),
            };
            dims[D - 1] = weight.dims()[3];
            let floats = [super::rows(x), weight].into_iter().chain(bias).collect();
            super::run(super::FusedOp::Linear, floats, None).reshape(dims)
        }
        RowPath::Burn | RowPath::BurnInF32 => {
            let (weight, bias) = match columns {
                Some([start, len]) => (
                    weight.narrow(1, start, len),
                    bias.map(|b| b.narrow(0, start, len)),
                ),
                None => (weight, bias),
            };
            burn::tensor::module::linear(x, weight, bias)
        }
        RowPath::Empty => {
            let mut dims = x.dims();
            dims[D - 1] = width;
            let (device, dtype) = (x.device(), x.dtype());
            match bias {
                // Rows without input features (`d_in = 0`): the bias alone, as PyTorch's.
                Some(bias) if !dims.contains(&0) => {
                    let bias = match columns {
                        Some([start, len]) => bias.narrow(0, start, len),
                        None => bias,
                    };
                    let inputs = once_with(|| zero_of(x)).chain(once_with(|| zero_of(weight)));
                    let mut shape = [1; D];
                    shape[D - 1] = dims[D - 1];
                    crate::empty::zeros(dims, &device, dtype, inputs) + bias.reshape(shape)
                }
                bias => {
                    let inputs = once_with(|| zero_of(x))
                        .chain(once_with(|| zero_of(weight)))
                        .chain(bias.into_iter().map(zero_of));
                    crate::empty::zeros(dims, &device, dtype, inputs)
                }
            }
        }
    }
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::{LinearGeluOp, LinearOp};

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::linear::{linear_backward, linear_forward, linear_gelu_forward};
    use crate::op::Op;

    /// `x W (+ b)` of `[x, weight]` or `[x, weight, bias]` (`[1, 1, rows, d_in]`, `[1, 1,
    /// d_in, d_out]`, `[1, 1, 1, d_out]`).
    pub(crate) struct LinearOp;

    /// What the backward pass keeps: the input and the weight.
    #[derive(Debug, Clone)]
    pub(crate) struct Saved<B: CpuTensors> {
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
    }

    impl<B: CpuTensors> Op<B> for LinearOp {
        type Saved = Saved<B>;

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
            let (x, weight, bias) = operands::<B>(floats);
            let y = linear_forward::<B>(&x, &weight, bias.as_ref());
            (y, Saved { x, weight })
        }

        fn backward(
            s: Saved<B>,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            linear_backward::<B>(&s.x, &s.weight, &grad, None, three(wanted)).into()
        }
    }

    /// `GELU(x W (+ b))` of `[x, weight]` or `[x, weight, bias]`, as [`LinearOp`]. Where a
    /// backward pass will run, the forward pass keeps GELU's derivative at each output
    /// (computed with its value) in place of the product, which no pass needs.
    pub(crate) struct LinearGeluOp;

    /// What the backward pass keeps: the input, the weight and GELU's derivative.
    #[derive(Debug, Clone)]
    pub(crate) struct SavedGelu<B: CpuTensors> {
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
        slope: FloatTensor<B>,
    }

    /// Which of the input, the weight and the bias want a gradient (a layer without a
    /// bias wants none for it).
    fn three(wanted: &[bool]) -> [bool; 3] {
        std::array::from_fn(|i| wanted.get(i).copied().unwrap_or(false))
    }

    /// The input, the weight and the bias (if any) of a linear layer's operation.
    fn operands<B: CpuTensors>(
        floats: Vec<FloatTensor<B>>,
    ) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>) {
        let mut floats = floats.into_iter();
        let (x, weight) = (floats.next(), floats.next());
        let (x, weight) = x.zip(weight).expect("linear takes an input and a weight");
        (x, weight, floats.next())
    }

    impl<B: CpuTensors> Op<B> for LinearGeluOp {
        type Saved = SavedGelu<B>;

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, SavedGelu<B>) {
            let (x, weight, bias) = operands::<B>(floats);
            let (y, slope) = linear_gelu_forward::<B>(&x, &weight, bias.as_ref(), true);
            let slope = slope.expect("the slope, asked for");
            (y, SavedGelu { x, weight, slope })
        }

        fn output(self, floats: Vec<FloatTensor<B>>) -> FloatTensor<B> {
            let (x, weight, bias) = operands::<B>(floats);
            linear_gelu_forward::<B>(&x, &weight, bias.as_ref(), false).0
        }

        fn backward(
            s: SavedGelu<B>,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            linear_backward::<B>(&s.x, &s.weight, &grad, Some(&s.slope), three(wanted)).into()
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Tensor, TensorData};

    use super::columns;

    use crate::testing::devices;

    /// Seeded values in `[-1, 1)`.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// `Σ a_p b_p` in f64 and the bound of its f32 rounding error: `(k + 1) ε Σ |a_p b_p|`
    /// covers every order of summation of the `k` products and an added bias (Higham's
    /// `γ_k`, with `ε = 2u`), fused multiply-adds or not.
    fn dot(pairs: impl Iterator<Item = (f32, f32)>) -> (f64, f64) {
        let (mut sum, mut size, mut k) = (0.0f64, 0.0f64, 0usize);
        for (a, b) in pairs {
            let p = a as f64 * b as f64;
            (sum, size, k) = (sum + p, size + p.abs(), k + 1);
        }
        (sum, (k + 1) as f64 * f32::EPSILON as f64 * size + 1e-30)
    }

    fn check(what: &str, got: Tensor<2>, want: &[(f64, f64)]) {
        let got = got.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &(w, bound))) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= bound,
                "{what}[{i}] = {g}, want {w} (bound {bound:e})"
            );
        }
    }

    /// `x W[:, c] + b[c]` and its gradients against f64, for sizes off the kernels' tile
    /// edges (1, odd, a few past 8, 16, 32, 64 and 128), with the input a strided view (a
    /// narrow of wider rows) or a transposed one, the weight transposed (PyTorch's
    /// `[out, in]` layout), and a slice of the weight's columns (a packed projection's).
    #[test]
    fn the_products_and_their_gradients_match_f64() {
        for device in devices() {
            for (case, &(rows, d_in, d_all, cols)) in [
                (1, 1, 1, None),
                (7, 17, 15, None),
                (33, 65, 47, Some([5, 20])),
                (130, 9, 100, Some([0, 33])),
                (4, 129, 3, Some([2, 1])),
            ]
            .iter()
            .enumerate()
            {
                let what = format!("{device:?} rows {rows} d_in {d_in} d_out {d_all} {cols:?}");
                let seed = case as u64 * 10;
                let x_host = values(rows * d_in, seed);
                let w_host = values(d_in * d_all, seed + 1);
                let b_host = values(d_all, seed + 2);
                let [start, len] = cols.unwrap_or([0, d_all]);
                let g_host = values(rows * len, seed + 3);
                // x: odd cases a narrow of rows 3 wider, even ones a transposed view.
                let x = match case % 2 {
                    1 => {
                        let wide: Vec<f32> = x_host
                            .chunks(d_in)
                            .flat_map(|row| row.iter().copied().chain([9.0; 3]))
                            .collect();
                        let wide = TensorData::new(wide, [rows, d_in + 3]);
                        Tensor::<2>::from_data(wide, &device).narrow(1, 0, d_in)
                    }
                    _ => {
                        let t: Vec<f32> = (0..d_in * rows)
                            .map(|at| x_host[(at % rows) * d_in + at / rows])
                            .collect();
                        let t = Tensor::<2>::from_data(TensorData::new(t, [d_in, rows]), &device);
                        t.transpose()
                    }
                }
                .require_grad();
                let w_t: Vec<f32> = (0..d_all * d_in)
                    .map(|at| w_host[(at % d_in) * d_all + at / d_in])
                    .collect();
                let w_t = TensorData::new(w_t, [d_all, d_in]);
                let weight = Tensor::<2>::from_data(w_t, &device).require_grad();
                let bias =
                    Tensor::<1>::from_data(TensorData::new(b_host.clone(), [d_all]), &device)
                        .require_grad();
                let y = columns(
                    x.clone(),
                    weight.clone().transpose(),
                    Some(bias.clone()),
                    cols,
                );
                let g =
                    Tensor::<2>::from_data(TensorData::new(g_host.clone(), [rows, len]), &device);
                let grads = (y.clone() * g).sum().backward();

                let want_y: Vec<(f64, f64)> = (0..rows * len)
                    .map(|at| {
                        let (r, j) = (at / len, start + at % len);
                        let bias = std::iter::once((b_host[j], 1.0));
                        let terms =
                            (0..d_in).map(|i| (x_host[r * d_in + i], w_host[i * d_all + j]));
                        dot(terms.chain(bias))
                    })
                    .collect();
                check(&format!("{what}: y"), y, &want_y);
                let want_dx: Vec<(f64, f64)> = (0..rows * d_in)
                    .map(|at| {
                        let (r, i) = (at / d_in, at % d_in);
                        dot((0..len).map(|j| (g_host[r * len + j], w_host[i * d_all + start + j])))
                    })
                    .collect();
                check(&format!("{what}: dx"), x.grad(&grads).unwrap(), &want_dx);
                // The weight's gradient in its `[out, in]` layout: zero outside the columns.
                let want_dw: Vec<(f64, f64)> = (0..d_all * d_in)
                    .map(|at| {
                        let (j, i) = (at / d_in, at % d_in);
                        match (start..start + len).contains(&j) {
                            true => dot((0..rows)
                                .map(|r| (x_host[r * d_in + i], g_host[r * len + j - start]))),
                            false => (0.0, 0.0),
                        }
                    })
                    .collect();
                check(
                    &format!("{what}: dW"),
                    weight.grad(&grads).unwrap(),
                    &want_dw,
                );
                let want_db: Vec<(f64, f64)> = (0..d_all)
                    .map(|j| match (start..start + len).contains(&j) {
                        true => dot((0..rows).map(|r| (g_host[r * len + j - start], 1.0))),
                        false => (0.0, 0.0),
                    })
                    .collect();
                let db = bias.grad(&grads).unwrap().reshape([1, d_all]);
                check(&format!("{what}: db"), db, &want_db);
            }
        }
    }

    /// [`super::forward_gelu`] against the layer then [`crate::ops::gelu::gelu`], values
    /// and the gradients of the input, the weight and the bias, on every backend: a small
    /// layer, and one large enough that the CPU kernels split its rows over the threads.
    #[test]
    fn gelu_in_the_layer_is_the_layer_then_gelu() {
        use burn::nn::LinearConfig;
        for device in devices() {
            for (case, &(rows, d_in, d_out)) in [(5, 3, 7), (300, 160, 160)].iter().enumerate() {
                let what = format!("{device:?} rows {rows} d_in {d_in} d_out {d_out}");
                let linear = LinearConfig::new(d_in, d_out).init(&device);
                let x_host = values(rows * d_in, 40 + case as u64);
                let g_host = values(rows * d_out, 50 + case as u64);
                let x = Tensor::<2>::from_data(TensorData::new(x_host, [rows, d_in]), &device);
                let g = Tensor::<2>::from_data(TensorData::new(g_host, [rows, d_out]), &device);
                let run = |fused: bool| {
                    let x = x.clone().require_grad();
                    let y = match fused {
                        true => super::forward_gelu(&linear, x.clone()),
                        false => crate::ops::gelu::gelu(super::forward(&linear, x.clone())),
                    };
                    let grads = (y.clone() * g.clone()).sum().backward();
                    let bias = linear.bias.as_ref().expect("a bias");
                    [
                        y.inner(),
                        x.grad(&grads).unwrap(),
                        linear.weight.grad(&grads).unwrap(),
                        bias.grad(&grads).unwrap().reshape([1, d_out]),
                    ]
                    .map(|t| t.into_data().convert::<f32>().to_vec::<f32>().unwrap())
                };
                let (fused, apart) = (run(true), run(false));
                for (name, (got, want)) in
                    ["y", "dx", "dW", "db"].iter().zip(fused.iter().zip(&apart))
                {
                    assert_eq!(got.len(), want.len(), "{what}: {name}");
                    for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "{what}: {name}[{i}] = {a}, the layer then GELU {b}"
                        );
                    }
                }
            }
        }
    }
}
