//! The gated feed-forward's SwiGLU, `SiLU(g) · u = g σ(g) u`, and its gradients
//! `dg = dy · u · σ(g) (1 + g (1 - σ(g)))` and `du = dy · g σ(g)`, over f32 rows, each
//! direction one pass with an `exp` that vectorises (Burn's SiLU on the CPU calls the C
//! library's scalar `expf` per element, then the product is a second pass).

use std::mem::MaybeUninit;

use rayon::prelude::*;

use burn::backend::tensor::FloatTensor;

use crate::cpu::isa::{Arch, Isa, Kernel};
use crate::cpu::{CpuTensors, dims_of, written};

use super::{CHUNK, chunks};

/// `SiLU(g) · u` of two rank-4 f32 tensors of one shape (read through their strides).
pub(crate) fn swiglu_forward<B: CpuTensors>(
    gate: &FloatTensor<B>,
    up: &FloatTensor<B>,
) -> FloatTensor<B> {
    let (gate, up) = (B::readable(gate), B::readable(up));
    let dims = dims_of::<B>(&gate);
    debug_assert_eq!(dims_of::<B>(&up), dims, "SwiGLU's inputs are of one shape");
    let (gate, up) = (
        B::floats(&gate).contiguous(dims),
        B::floats(&up).contiguous(dims),
    );
    let isa = Isa::best();
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(out, (gate, up))| isa.run(Forward { gate, up, out }))
    };
    // SAFETY: the chunks cover `out`, and `Forward` writes each of its elements.
    B::from_rows(unsafe { written(gate.len(), fill) }, dims)
}

/// The gradients of [`swiglu_forward`] from the output's gradient `grad` (rank 4, the
/// inputs' shape): `[dg, du]`, each only where `wanted`.
pub(crate) fn swiglu_backward<B: CpuTensors>(
    gate: &FloatTensor<B>,
    up: &FloatTensor<B>,
    grad: &FloatTensor<B>,
    wanted: [bool; 2],
) -> [Option<FloatTensor<B>>; 2] {
    let (gate, up, grad) = (B::readable(gate), B::readable(up), B::readable(grad));
    let dims = dims_of::<B>(&gate);
    let gate = B::floats(&gate).contiguous(dims);
    let up = B::floats(&up).contiguous(dims);
    let grad = B::floats(&grad).contiguous(dims);
    let len = gate.len();
    let isa = Isa::best();
    let mut outs = wanted.map(|want| want.then(|| Vec::<f32>::with_capacity(len)));
    let [dg_out, du_out] = &mut outs;
    let (dg_chunks, du_chunks) = (chunks(dg_out, len), chunks(du_out, len));
    dg_chunks
        .into_par_iter()
        .zip(du_chunks)
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK).zip(grad.par_chunks(CHUNK)))
        .for_each(|(((dg, du), gate), (up, grad))| {
            isa.run(Backward {
                gate,
                up,
                grad,
                dg,
                du,
            })
        });
    outs.map(|out| {
        out.map(|mut out| {
            // SAFETY: `Backward` wrote every element of each chunk of a wanted gradient.
            unsafe { out.set_len(len) };
            B::from_rows(out, dims)
        })
    })
}

/// `SiLU(gate) · up` into `out` (every element written).
struct Forward<'a> {
    gate: &'a [f32],
    up: &'a [f32],
    out: &'a mut [MaybeUninit<f32>],
}

impl Kernel for Forward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        for ((o, &g), &u) in self.out.iter_mut().zip(self.gate).zip(self.up) {
            o.write(g * sigmoid::<A>(g) * u);
        }
    }
}

/// The gradients of `gate` and `up` from the output's `grad`, into `dg` and `du` where
/// given (every element of each written).
struct Backward<'a> {
    gate: &'a [f32],
    up: &'a [f32],
    grad: &'a [f32],
    dg: Option<&'a mut [MaybeUninit<f32>]>,
    du: Option<&'a mut [MaybeUninit<f32>]>,
}

impl Kernel for Backward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        let inputs = self.gate.iter().zip(self.up).zip(self.grad);
        match (self.dg, self.du) {
            (Some(dg), Some(du)) => {
                for ((dg, du), ((&g, &u), &dy)) in dg.iter_mut().zip(du).zip(inputs) {
                    let [slope, silu] = slope_and_silu::<A>(g);
                    dg.write(dy * u * slope);
                    du.write(dy * silu);
                }
            }
            (Some(dg), None) => {
                for (dg, ((&g, &u), &dy)) in dg.iter_mut().zip(inputs) {
                    dg.write(dy * u * slope_and_silu::<A>(g)[0]);
                }
            }
            (None, Some(du)) => {
                for (du, ((&g, _), &dy)) in du.iter_mut().zip(inputs) {
                    du.write(dy * slope_and_silu::<A>(g)[1]);
                }
            }
            (None, None) => {}
        }
    }
}

/// `[σ(x), 1 - σ(x)]`, from `e = e^-|x|` (in `(0, 1]`, never overflowing):
/// `[1/(1+e), e/(1+e)]` for `x ≥ 0`, swapped below. Branch-free (a select), exact 0 where
/// `e` is (`x` below -87.3), and `1 - σ` without cancellation.
#[inline(always)]
fn sigmoid_pair<A: Arch>(x: f32) -> [f32; 2] {
    let e = A::exp(-x.abs());
    let r = 1.0 / (1.0 + e);
    let (big, small) = (r, e * r);
    if x >= 0.0 { [big, small] } else { [small, big] }
}

/// `σ(x)`.
#[inline(always)]
fn sigmoid<A: Arch>(x: f32) -> f32 {
    sigmoid_pair::<A>(x)[0]
}

/// `[SiLU'(x), SiLU(x)] = [σ(x) (1 + x (1 - σ(x))), x σ(x)]`.
#[inline(always)]
fn slope_and_silu<A: Arch>(x: f32) -> [f32; 2] {
    let [s, one_minus_s] = sigmoid_pair::<A>(x);
    [A::madd(x * s, one_minus_s, s), x * s]
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::{Backward, Forward};
    #[cfg(target_arch = "x86_64")]
    use crate::cpu::isa::Avx2;
    use crate::cpu::isa::{Arch, Kernel, Portable};

    /// `[SiLU(g) u, dg, du]` in f64 for the output gradient `dy`.
    fn reference(g: f32, u: f32, dy: f32) -> [f64; 3] {
        let (g, u, dy) = (g as f64, u as f64, dy as f64);
        let s = 1.0 / (1.0 + (-g).exp());
        let silu = g * s;
        [silu * u, dy * u * s * (1.0 + g * (1.0 - s)), dy * silu]
    }

    /// The three values for the inputs `g`, `u`, `dy` by `A`'s kernels, every gradient
    /// wanted, and each alone (which must give the same numbers).
    /// [`computed`] by each instruction set this build has kernels for.
    fn on_every_isa(g: &[f32], u: &[f32], dy: &[f32]) -> Vec<[Vec<f32>; 3]> {
        #[cfg(target_arch = "x86_64")]
        return vec![computed::<Portable>(g, u, dy), computed::<Avx2>(g, u, dy)];
        #[cfg(not(target_arch = "x86_64"))]
        vec![computed::<Portable>(g, u, dy)]
    }

    fn computed<A: Arch>(g: &[f32], u: &[f32], dy: &[f32]) -> [Vec<f32>; 3] {
        let len = g.len();
        let fresh = || vec![MaybeUninit::new(f32::NAN); len];
        let read = |v: Vec<MaybeUninit<f32>>| -> Vec<f32> {
            // SAFETY: initialised (NaN) before the kernels ran.
            v.into_iter().map(|x| unsafe { x.assume_init() }).collect()
        };
        let mut out = fresh();
        Forward {
            gate: g,
            up: u,
            out: &mut out,
        }
        .run::<A>();
        let backward = |dg, du| {
            Backward {
                gate: g,
                up: u,
                grad: dy,
                dg,
                du,
            }
            .run::<A>()
        };
        let (mut dg, mut du) = (fresh(), fresh());
        backward(Some(&mut dg), Some(&mut du));
        let (mut dg_alone, mut du_alone) = (fresh(), fresh());
        backward(Some(&mut dg_alone), None);
        backward(None, Some(&mut du_alone));
        let [dg, du] = [read(dg), read(du)];
        assert_eq!(read(dg_alone), dg, "dg alone");
        assert_eq!(read(du_alone), du, "du alone");
        [read(out), dg, du]
    }

    #[test]
    fn the_value_and_both_gradients_match_f64_over_the_line() {
        // g over [-100, 100] (both of exp's saturations), u and dy of both signs.
        let g: Vec<f32> = (-100_000..=100_000).map(|i| i as f32 * 1e-3).collect();
        let u: Vec<f32> = (0..g.len())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
            .collect();
        let dy: Vec<f32> = (0..g.len())
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.02)
            .collect();
        let all = on_every_isa(&g, &u, &dy);
        for got in all {
            let mut worst = [0.0f64; 3];
            for i in 0..g.len() {
                let want = reference(g[i], u[i], dy[i]);
                for (w, (got, want)) in worst.iter_mut().zip(got.iter().map(|v| v[i]).zip(want)) {
                    // Relative to the size of the terms (a product of three of them).
                    let scale = (g[i].abs().max(1.0) * u[i].abs().max(1.0)) as f64
                        * (dy[i].abs().max(1.0)) as f64;
                    *w = w.max((got as f64 - want).abs() / scale);
                }
            }
            // exp's 2 ulp and a few f32 roundings.
            assert!(
                worst.iter().all(|&w| w < 1e-6),
                "worst errors [out, dg, du] {worst:?}"
            );
        }
    }

    /// Far past exp's range σ is exactly 0 or 1: below, the value and both gradients are
    /// 0 (not `g` times a tiny σ, which grows with |g|); above, SiLU is the identity.
    #[test]
    fn far_gates_are_exact() {
        let g = [-f32::MAX, -3e38, -1e10, -1e3, -90.0, 90.0, 1e3, 1e10];
        let u = [1.5, -0.5, 2.0, -1.25, 0.75, 1.5, -0.5, 2.0];
        let dy = [0.5, 2.0, -1.5, 1.0, -0.25, 0.5, 2.0, -1.5];
        let all = on_every_isa(&g, &u, &dy);
        for [out, dg, du] in all {
            for i in 0..g.len() {
                let want = match g[i] < 0.0 {
                    true => [0.0; 3],
                    false => [g[i] * u[i], dy[i] * u[i], dy[i] * g[i]],
                };
                assert_eq!([out[i], dg[i], du[i]], want, "g = {}", g[i]);
            }
        }
    }
}
