//! Removing heads: a smaller module whose outputs equal those of the module with the same
//! heads masked ([`HeadMask`](super::HeadMask)), which saves and loads like any module.
//!
//! A [`PrunePlan`] names the heads to remove per attention layer (in the order of
//! [`crate::inspect`]). Query heads go with their slices of the query projection and of
//! the output projection; a key/value head goes only when every query head of its group
//! goes. When the groups left are of different sizes (grouped-query attention with some
//! of a group's heads removed), the key/value heads are repeated (their weights copied)
//! until every group has the same size again, the greatest common divisor of the sizes
//! left: the outputs stay equal, and the key/value projection is that much wider.
//!
//! Each parameter of a pruned module is a new one (a new id: an optimizer's state for the
//! full module does not carry over), trained or frozen as the one it was cut from. One
//! with a LoRA adapter (Burn's `Module::apply_lora`) is cut from its value with the
//! adapter's product added (`Param::val`): the pruned module computes what the adapted
//! one did, that adapter merged into a parameter frozen as its base was (the parameters
//! pruning does not cut, a feed-forward's, keep theirs). Prune before attaching adapters
//! to fine-tune the pruned attention. A quantized parameter (Burn's `quantize_weights`)
//! is cut from its dequantized value: the pruned attention's parameters are floats.
//!
//! To load a pruned module saved with Burn's `save_file`, build the full module from its
//! configuration, prune it with the same plan (saved beside it, it serialises to JSON;
//! with every plan in turn, for a module pruned more than once), and load the record into
//! that (`load_file`, `try_load_file`). Not into a module built at the smaller size: its
//! shapes may match, but an ALiBi module would give its heads the slopes of a module of
//! that many heads, not those of the heads it kept (which only the pruning records).

use burn::module::{Param, ParamId};
use burn::nn::Linear;
use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::block::{DecoderBlock, EncoderBlock};
use crate::error::PruneError;
use crate::mha::{InputProjection, MultiHeadAttention, PrunedFrom, SeparateProjection};
use crate::stack::{Decoder, Encoder};

/// The heads of a module, and how to remove some of them.
pub trait Heads: Sized {
    /// The heads of each attention layer, in order (see [`crate::inspect`]); the
    /// module's own `head_counts`.
    fn head_counts(&self) -> Vec<usize>;

    /// The module without the heads `plan` removes.
    ///
    /// # Errors
    /// [`PruneError`] when the plan has another number of attention layers than the
    /// module, names a head the layer does not have, or removes every head of a layer.
    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError>;
}

/// The heads to remove, per attention layer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrunePlan {
    /// For each attention layer, the heads to remove (indices into that layer's heads).
    pub remove: Vec<Vec<usize>>,
}

impl PrunePlan {
    /// Removes nothing from `layers` attention layers.
    pub fn keep_all(layers: usize) -> Self {
        Self {
            remove: vec![Vec::new(); layers],
        }
    }

    /// Removes the `(layer, head)` pairs of `heads` from `layers` attention layers (each
    /// layer's heads sorted, named once).
    ///
    /// # Panics
    /// If a layer is not one of the `layers`, naming it.
    pub fn removing(layers: usize, heads: &[(usize, usize)]) -> Self {
        let mut plan = Self::keep_all(layers);
        for &(layer, head) in heads {
            let Some(row) = plan.remove.get_mut(layer) else {
                panic!(
                    "PrunePlan::removing: head {head} of layer {layer}, past the {layers} layers"
                );
            };
            row.push(head);
        }
        for row in &mut plan.remove {
            row.sort_unstable();
            row.dedup();
        }
        plan
    }

    /// The number of heads removed.
    pub fn removed(&self) -> usize {
        self.remove.iter().map(Vec::len).sum()
    }

    /// Attention layers `start..start + len` as a plan of their own: the part of a
    /// model's plan that one of its stacks takes.
    ///
    /// # Panics
    /// If the range passes the plan's last layer.
    pub fn slice(&self, start: usize, len: usize) -> PrunePlan {
        let layers = self.remove.len();
        assert!(
            start.checked_add(len).is_some_and(|end| end <= layers),
            "PrunePlan::slice: layers {start}..{start}+{len} pass the plan's {layers} layers"
        );
        PrunePlan {
            remove: self.remove[start..start + len].to_vec(),
        }
    }

    fn check_layers(&self, module: &'static str, layers: usize) -> Result<(), PruneError> {
        match self.remove.len() == layers {
            true => Ok(()),
            false => Err(PruneError::Layers {
                module,
                layers,
                plan: self.remove.len(),
            }),
        }
    }
}

impl Heads for MultiHeadAttention {
    fn head_counts(&self) -> Vec<usize> {
        MultiHeadAttention::head_counts(self)
    }

    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError> {
        plan.check_layers("MultiHeadAttention", 1)?;
        prune_attention(self, &plan.remove[0], 0)
    }
}

/// `attention` without the heads `remove`; `layer` names it in errors.
fn prune_attention(
    attention: &MultiHeadAttention,
    remove: &[usize],
    layer: usize,
) -> Result<MultiHeadAttention, PruneError> {
    let heads = attention.n_heads;
    if let Some(&head) = remove.iter().find(|&&h| h >= heads) {
        return Err(PruneError::Head { layer, head, heads });
    }
    let kept: Vec<usize> = (0..heads).filter(|h| !remove.contains(h)).collect();
    if kept.is_empty() {
        return Err(PruneError::Empty { layer, heads });
    }
    // Key/value heads: each kept group, repeated until the groups have one size.
    let group = heads / attention.n_kv_heads;
    let mut sizes = vec![0usize; attention.n_kv_heads];
    for &h in &kept {
        sizes[h / group] += 1;
    }
    let size = sizes.iter().filter(|&&s| s > 0).fold(0, |a, &s| gcd(a, s));
    let kv_kept: Vec<usize> = sizes
        .iter()
        .enumerate()
        .flat_map(|(g, &s)| std::iter::repeat_n(g, s / size))
        .collect();

    let dh = attention.head_dim;
    let columns = |heads: &[usize], start: usize| -> Vec<usize> {
        heads
            .iter()
            .flat_map(|&h| start + h * dh..start + (h + 1) * dh)
            .collect()
    };
    let q_width = heads * dh;
    let kv_width = attention.n_kv_heads * dh;
    let in_proj = match &attention.in_proj {
        InputProjection::Packed(proj) => {
            let mut cols = columns(&kept, 0);
            cols.extend(columns(&kv_kept, q_width));
            cols.extend(columns(&kv_kept, q_width + kv_width));
            InputProjection::Packed(select_outputs(proj, &cols))
        }
        InputProjection::Separate(proj) => InputProjection::Separate(SeparateProjection {
            q_proj: select_outputs(&proj.q_proj, &columns(&kept, 0)),
            k_proj: select_outputs(&proj.k_proj, &columns(&kv_kept, 0)),
            v_proj: select_outputs(&proj.v_proj, &columns(&kv_kept, 0)),
        }),
    };
    let out_proj = Linear {
        weight: select_param(&attention.out_proj.weight, 0, &columns(&kept, 0)),
        bias: attention
            .out_proj
            .bias
            .as_ref()
            .map(|b| like(b, b.val().detach())),
    };
    let original = match &attention.pruned_from {
        Some(from) => PrunedFrom {
            heads: from.heads,
            kept: kept.iter().map(|&h| from.kept[h]).collect(),
        },
        None => PrunedFrom {
            heads,
            kept: kept.clone(),
        },
    };
    Ok(MultiHeadAttention {
        in_proj,
        out_proj,
        dropout: attention.dropout.clone(),
        n_heads: kept.len(),
        n_kv_heads: kv_kept.len(),
        head_dim: dh,
        kdim: attention.kdim,
        vdim: attention.vdim,
        scale: attention.scale,
        softcap: attention.softcap,
        // A norm of each head's features, the same for every head.
        q_norm: attention.q_norm.as_ref().map(detached),
        k_norm: attention.k_norm.as_ref().map(detached),
        positions: attention.positions.clone(),
        position_table: attention
            .position_table
            .as_ref()
            .map(|t| select_param(t, 0, &kept)),
        sinks: attention.sinks.as_ref().map(|t| select_param(t, 0, &kept)),
        quiet_softmax: attention.quiet_softmax,
        pruned_from: Some(original),
    })
}

/// `norm` with its scale and shift as new leaves.
fn detached(norm: &crate::norm::LayerNorm) -> crate::norm::LayerNorm {
    let mut norm = norm.clone();
    norm.gamma = like(&norm.gamma, norm.gamma.val().detach());
    norm.beta = norm.beta.as_ref().map(|b| like(b, b.val().detach()));
    norm
}

/// `value` (a leaf) as a new parameter trained as `source` is: frozen where it is
/// (`Module::freeze`, `no_grad`, the fixed sinks of a module converted from Burn's), with
/// its load and save mappers; a new id, since its shape is not `source`'s.
fn like<const D: usize>(source: &Param<Tensor<D>>, value: Tensor<D>) -> Param<Tensor<D>> {
    let (_, old, mapper) = source.clone().consume();
    let value = match old.is_require_grad() {
        true => value.require_grad(),
        false => value,
    };
    Param::from_mapped_value(ParamId::new(), value, mapper)
}

/// The entries `index` of `param` along `dim`, as a new parameter trained as `param` is.
fn select_param<const D: usize>(
    param: &Param<Tensor<D>>,
    dim: usize,
    index: &[usize],
) -> Param<Tensor<D>> {
    // Dequantized first: the selection of a quantized tensor is quantized again, on a new
    // scale, on some backends (wgpu), which would change the weights kept.
    like(
        param,
        select(crate::dtype::float_value(param.val()), dim, index),
    )
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// The entries `index` of `x` along `dim`, as a new leaf.
fn select<const D: usize>(x: Tensor<D>, dim: usize, index: &[usize]) -> Tensor<D> {
    let device = x.device();
    let index: Vec<i64> = index.iter().map(|&i| i as i64).collect();
    let len = index.len();
    let index = Tensor::<1, Int>::from_data(TensorData::new(index, [len]), &device);
    x.select(dim, index).detach()
}

/// `linear` with only the output columns `cols`.
fn select_outputs(linear: &Linear, cols: &[usize]) -> Linear {
    Linear {
        weight: select_param(&linear.weight, 1, cols),
        bias: linear.bias.as_ref().map(|b| select_param(b, 0, cols)),
    }
}

impl Heads for EncoderBlock {
    fn head_counts(&self) -> Vec<usize> {
        EncoderBlock::head_counts(self)
    }

    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError> {
        plan.check_layers("EncoderBlock", 1)?;
        Ok(EncoderBlock {
            self_attn: prune_attention(&self.self_attn, &plan.remove[0], 0)?,
            ..self.clone()
        })
    }
}

impl Heads for DecoderBlock {
    fn head_counts(&self) -> Vec<usize> {
        DecoderBlock::head_counts(self)
    }

    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError> {
        plan.check_layers("DecoderBlock", 2)?;
        Ok(DecoderBlock {
            self_attn: prune_attention(&self.self_attn, &plan.remove[0], 0)?,
            cross_attn: prune_attention(&self.cross_attn, &plan.remove[1], 1)?,
            ..self.clone()
        })
    }
}

/// The blocks of a stack pruned with consecutive parts of `plan`, `per_block` attention
/// layers each; errors name the layer within the stack.
fn prune_blocks<T: Heads>(
    blocks: &[T],
    plan: &PrunePlan,
    per_block: usize,
    module: &'static str,
) -> Result<Vec<T>, PruneError> {
    plan.check_layers(module, blocks.len() * per_block)?;
    blocks
        .iter()
        .enumerate()
        .map(|(i, block)| {
            block
                .prune(&plan.slice(i * per_block, per_block))
                .map_err(|e| e.at_layer(i * per_block))
        })
        .collect()
}

impl Heads for Encoder {
    fn head_counts(&self) -> Vec<usize> {
        Encoder::head_counts(self)
    }

    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError> {
        Ok(Encoder {
            layers: prune_blocks(&self.layers, plan, 1, "Encoder")?,
            ..self.clone()
        })
    }
}

impl Heads for Decoder {
    fn head_counts(&self) -> Vec<usize> {
        Decoder::head_counts(self)
    }

    fn prune(&self, plan: &PrunePlan) -> Result<Self, PruneError> {
        Ok(Decoder {
            layers: prune_blocks(&self.layers, plan, 2, "Decoder")?,
            ..self.clone()
        })
    }
}
