//! The importers of attention: PyTorch's `nn.MultiheadAttention` (packed or separate
//! projections), Hugging Face's `T5Attention` and learned position tables.

use super::*;

impl LoadPyTorch for MultiHeadAttention {
    /// Keys of `nn.MultiheadAttention`: `in_proj_weight` (or `q_proj_weight`,
    /// `k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ), `in_proj_bias`,
    /// `out_proj.weight`, `out_proj.bias`; or those of Hugging Face's `T5Attention`
    /// (`q.weight`, `k.weight`, `v.weight`, `o.weight`), when `q.weight` is there and
    /// `in_proj_weight` is not (see the [module docs](crate::pytorch) for what T5 needs);
    /// or those of Hugging Face's Llama-family attention (Llama, Mistral, Qwen2, Qwen3:
    /// `q_proj.*`, `k_proj.*`, `v_proj.*`, `o_proj.*`, each with its bias where the model
    /// has one), when `q_proj.weight` is there and `in_proj_weight` is not.
    ///
    /// A module with a learned relative-position table ([`Positions::Relative`],
    /// [`Positions::T5`]) loads it too, from `position_table` `[H, buckets]` or T5's
    /// `relative_attention_bias.weight` `[buckets, H]`: weights without one are an error,
    /// not a table of zeros. A module with QK-norm loads `q_norm.weight` and
    /// `k_norm.weight` `[Dh]` (Qwen3's names); one without refuses them. A module with
    /// attention sinks loads `sinks` `[H]` (gpt-oss's name); one without refuses it.
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let has = |key: &str| weights.contains(&format!("{prefix}{key}"));
        let packed = has("in_proj_weight");
        let mut mha = match () {
            _ if has("q.weight") && !packed => load_t5(self, weights, prefix)?,
            _ if has("q_proj.weight") && !packed => load_hf(self, weights, prefix)?,
            _ => load_torch_mha(self, weights, prefix)?,
        };
        mha.position_table = load_position_table(&mha, weights, prefix)?;
        mha.q_norm = load_qk_norm(mha.q_norm, weights, &format!("{prefix}q_norm."))?;
        mha.k_norm = load_qk_norm(mha.k_norm, weights, &format!("{prefix}k_norm."))?;
        mha.sinks = load_sinks(&mha, weights, &format!("{prefix}sinks"))?;
        Ok(mha)
    }
}

/// The attention sinks' logits `[H]` from `key`, or, for a module without sinks, that key
/// refused.
fn load_sinks(
    mha: &MultiHeadAttention,
    weights: &PyTorchWeights,
    key: &str,
) -> Result<Option<Param<Tensor<1>>>, ImportError> {
    match &mha.sinks {
        Some(sinks) if mha.quiet_softmax => {
            weights.reject(
                key.to_string(),
                "the module's sinks are Burn's quiet softmax, fixed at 0 (`quiet_softmax`); \
                 configure learned ones with `sinks` instead",
            )?;
            Ok(Some(sinks.clone()))
        }
        Some(sinks) => {
            let loaded = Place::of(sinks).load_as_stored(weights, key, [mha.n_heads])?;
            // A logit of +inf or NaN makes every row's weights NaN or 0: refused here,
            // where it is read once (-inf: that head has no sink).
            let values = loaded.clone().into_data().convert::<f32>();
            let values = values.try_into_vec::<f32>().unwrap_or_default();
            if let Some((head, x)) = values
                .iter()
                .enumerate()
                .find(|(_, x)| x.is_nan() || **x == f32::INFINITY)
            {
                return Err(ImportError::Convention {
                    key: key.to_string(),
                    message: format!(
                        "the attention sinks' logits must be finite (or -inf: no sink), head \
                         {head}'s is {x}"
                    ),
                });
            }
            Ok(Some(set(sinks.clone(), loaded)))
        }
        None => {
            weights.reject(
                key.to_string(),
                "the module was configured without attention sinks (`sinks`)",
            )?;
            Ok(None)
        }
    }
}

/// A QK-norm's scale from `{prefix}weight`, or, for a module without QK-norm, that key
/// refused.
fn load_qk_norm(
    norm: Option<LayerNorm>,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<Option<LayerNorm>, ImportError> {
    match norm {
        Some(norm) => norm.load_pytorch(weights, prefix).map(Some),
        None => {
            weights.reject(
                format!("{prefix}weight"),
                "the module was configured without QK-norm (`qk_norm_eps`)",
            )?;
            Ok(None)
        }
    }
}

/// The projections of `nn.MultiheadAttention`.
fn load_torch_mha(
    mut mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<MultiHeadAttention, ImportError> {
    for extra in ["bias_k", "bias_v"] {
        weights.reject(
            format!("{prefix}{extra}"),
            "add_bias_kv=True has no counterpart in MultiHeadAttention",
        )?;
    }
    let q_width = mha.n_heads * mha.head_dim;
    let kv_width = mha.n_kv_heads * mha.head_dim;
    let total = q_width + 2 * kv_width;
    let bias = format!("{prefix}in_proj_bias");
    mha.in_proj = match mha.in_proj {
        InputProjection::Packed(proj) => {
            let weight = format!("{prefix}in_proj_weight");
            InputProjection::Packed(load_linear_from(
                proj,
                weights,
                Stored::rows(&weight, total, 0),
                Stored::rows(&bias, total, 0),
            )?)
        }
        InputProjection::Separate(p) => {
            // Separate weights, but PyTorch still packs the three biases.
            let (q, k, v) = (
                format!("{prefix}q_proj_weight"),
                format!("{prefix}k_proj_weight"),
                format!("{prefix}v_proj_weight"),
            );
            InputProjection::Separate(SeparateProjection {
                q_proj: load_linear_from(
                    p.q_proj,
                    weights,
                    Stored::whole(&q),
                    Stored::rows(&bias, total, 0),
                )?,
                k_proj: load_linear_from(
                    p.k_proj,
                    weights,
                    Stored::whole(&k),
                    Stored::rows(&bias, total, q_width),
                )?,
                v_proj: load_linear_from(
                    p.v_proj,
                    weights,
                    Stored::whole(&v),
                    Stored::rows(&bias, total, q_width + kv_width),
                )?,
            })
        }
    };
    mha.out_proj = load_linear(mha.out_proj, weights, &format!("{prefix}out_proj."))?;
    Ok(mha)
}

/// The projections of Hugging Face's `T5Attention` (`transformers`): `q.weight`,
/// `k.weight`, `v.weight` `[num_heads · d_kv, d_model]` and `o.weight`
/// `[d_model, num_heads · d_kv]`, without biases. Its scores are not scaled (T5 folds
/// `1/sqrt(d_kv)` into its initialisation) and its heads are `d_kv` wide: the module must
/// be configured `with_bias(false)` and `with_scale(Some(1.0))`, with heads `d_kv` wide
/// (`with_head_dim` where `num_heads · d_kv != d_model`); anything else is an
/// [`ImportError::Convention`] saying what to change, since the numbers would differ.
fn load_t5(
    mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<MultiHeadAttention, ImportError> {
    let key = |name: &str| format!("{prefix}{name}");
    let convention = |message: String| ImportError::Convention {
        key: key("q.weight"),
        message,
    };
    let in_bias = match &mha.in_proj {
        InputProjection::Packed(p) => p.bias.is_some(),
        InputProjection::Separate(p) => p.q_proj.bias.is_some(),
    };
    if in_bias || mha.out_proj.bias.is_some() {
        return Err(convention(
            "Hugging Face's T5Attention has no biases in q, k, v and o; configure the \
             module with_bias(false)"
                .into(),
        ));
    }
    if mha.scale != 1.0 {
        return Err(convention(format!(
            "Hugging Face's T5Attention does not scale its scores (scale 1: T5 folds \
             1/sqrt(d_kv) into its initialisation); configure the module with_scale(Some(1.0)), \
             it has {}",
            mha.scale
        )));
    }
    let d_model = mha.d_model();
    let q_width = mha.n_heads * mha.head_dim;
    if let Some(&[inner, width]) = weights.shape(&key("q.weight")).as_deref()
        && width == d_model
        && inner != q_width
    {
        return Err(convention(format!(
            "T5's heads are {inner} / {} = d_kv wide ({inner} = num_heads · d_kv), \
             MultiHeadAttention's are {}: configure the module with_head_dim(Some(d_kv))",
            mha.n_heads, mha.head_dim
        )));
    }
    load_projections(mha, weights, ["q.", "k.", "v.", "o."].map(key))
}

/// The projections of Hugging Face's Llama-family attention (`LlamaAttention`,
/// `MistralAttention`, `Qwen2Attention`, `Qwen3Attention`): `q_proj`, `k_proj`, `v_proj`
/// `[heads · head_dim, d_model]` and `o_proj` `[d_model, H · head_dim]`, with biases where
/// the model has them (Qwen2 on q, k and v: configure the module `with_out_bias(Some(false))`).
/// Their scores are scaled by `1/sqrt(head_dim)`, as the module's default; heads of
/// another width than the module's (`head_dim` in the model's configuration, which
/// `with_head_dim` sets) are an [`ImportError::Convention`].
fn load_hf(
    mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<MultiHeadAttention, ImportError> {
    let key = |name: &str| format!("{prefix}{name}");
    let d_model = mha.d_model();
    let q_width = mha.n_heads * mha.head_dim;
    if let Some(&[rows, width]) = weights.shape(&key("q_proj.weight")).as_deref()
        && width == d_model
        && rows != q_width
    {
        return Err(ImportError::Convention {
            key: key("q_proj.weight"),
            message: format!(
                "the model's queries are {rows} wide (num_attention_heads · head_dim), \
                 MultiHeadAttention's {} heads of {} = {q_width}: configure the module \
                 with_head_dim(Some(head_dim))",
                mha.n_heads, mha.head_dim
            ),
        });
    }
    load_projections(
        mha,
        weights,
        ["q_proj.", "k_proj.", "v_proj.", "o_proj."].map(key),
    )
}

/// The query, key, value and output projections from four separate linears (`{at}weight`
/// `[out, in]` and `{at}bias` `[out]` for each `at` of `[q, k, v, o]`), packed into the
/// module's one input projection where it has one.
pub(crate) fn load_projections(
    mut mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    [q, k, v, o]: [String; 4],
) -> Result<MultiHeadAttention, ImportError> {
    let q_width = mha.n_heads * mha.head_dim;
    let kv_width = mha.n_kv_heads * mha.head_dim;
    mha.in_proj = match mha.in_proj {
        InputProjection::Packed(proj) => {
            let [d_in, _] = proj.weight.lazy_shape().dims::<2>();
            let weight = Place::of(&proj.weight);
            let parts = [(&q, q_width), (&k, kv_width), (&v, kv_width)];
            let loaded = parts
                .iter()
                .map(|(at, rows)| weight.load(weights, &format!("{at}weight"), [*rows, d_in]))
                .collect::<Result<Vec<_>, _>>()?;
            let bias = match proj.bias {
                Some(bias) => {
                    let place = Place::of(&bias);
                    let loaded = parts
                        .iter()
                        .map(|(at, rows)| place.load(weights, &format!("{at}bias"), [*rows]))
                        .collect::<Result<Vec<_>, _>>()?;
                    Some(set(bias, Tensor::cat(loaded, 0)))
                }
                None => {
                    for (at, _) in parts {
                        weights.reject(
                            format!("{at}bias"),
                            "the module was configured without bias",
                        )?;
                    }
                    None
                }
            };
            InputProjection::Packed(Linear {
                weight: set(proj.weight, Tensor::cat(loaded, 0).transpose()),
                bias,
            })
        }
        InputProjection::Separate(p) => InputProjection::Separate(SeparateProjection {
            q_proj: load_linear(p.q_proj, weights, &q)?,
            k_proj: load_linear(p.k_proj, weights, &k)?,
            v_proj: load_linear(p.v_proj, weights, &v)?,
        }),
    };
    mha.out_proj = load_linear(mha.out_proj, weights, &o)?;
    Ok(mha)
}

/// The learned relative-position table of a module with [`Positions::Relative`] or
/// [`Positions::T5`], from `{prefix}position_table` in mha's layout `[H, buckets]`, or
/// from Hugging Face's T5 `{prefix}relative_attention_bias.weight` `[buckets, H]` (an
/// `nn.Embedding(num_buckets, num_heads)`), transposed. A module without a table refuses
/// either key; a module with one needs one of them.
fn load_position_table(
    mha: &MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<Option<Param<Tensor<2>>>, ImportError> {
    let ours = format!("{prefix}position_table");
    let hf = format!("{prefix}relative_attention_bias.weight");
    let (table, buckets) = match (&mha.position_table, mha.positions.buckets()) {
        (Some(table), Some(buckets)) => (table.clone(), buckets),
        _ => {
            weights.reject(
                ours,
                "the module has no learned position table (configure Positions::Relative or \
                 Positions::T5)",
            )?;
            weights.reject(
                hf,
                "Hugging Face's T5 relative bias needs Positions::T5 with the layer's \
                 relative_attention_num_buckets, relative_attention_max_distance and \
                 bidirectional = !is_decoder",
            )?;
            return Ok(mha.position_table.clone());
        }
    };
    let [heads, len] = [mha.n_heads, buckets.len()];
    let place = Place::of(&table);
    if weights.contains(&ours) {
        weights.reject(
            hf,
            "the weights also hold position_table; keep one of the two",
        )?;
        return Ok(Some(set(table, place.load(weights, &ours, [heads, len])?)));
    }
    if weights.contains(&hf) {
        if !matches!(mha.positions, Positions::T5 { .. }) {
            return Err(ImportError::Convention {
                key: hf,
                message: format!(
                    "Hugging Face's T5 table indexes T5's buckets; the module's positions are \
                     {:?} (configure Positions::T5)",
                    mha.positions
                ),
            });
        }
        let stored = place.load(weights, &hf, [len, heads])?; // [buckets, H]
        return Ok(Some(set(table, stored.transpose())));
    }
    Err(ImportError::Convention {
        key: ours,
        message: format!(
            "the module's {:?} positions have a learned table of [heads, buckets] = \
             [{heads}, {len}], which the weights lack: store it under this key in that layout \
             (see MultiHeadAttention::position_table), or under relative_attention_bias.weight \
             as Hugging Face's T5 does ([buckets, heads]; T5 keeps it in the first layer of each \
             stack only and the others reuse it: put it under each layer's key with \
             PyTorchWeights::share)",
            mha.positions
        ),
    })
}
