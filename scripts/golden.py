#!/usr/bin/env python3
"""Writes the PyTorch reference fixtures the tests compare against.

    python3 -m pip install torch safetensors transformers
    python3 scripts/golden.py                           # writes tests/fixtures/*.safetensors
    python3 scripts/golden.py mha_bf16 mha_t5_causal    # only the fixtures named (see FIXTURES)

Each fixture is one safetensors file holding
- `model.*`: the PyTorch module's state_dict, exactly as a user would save it (the tests
  load it through mha's public import, with the prefix "model.");
- `io.*`: inputs, the random upstream gradient `io.grad_out`, and PyTorch's results:
  `io.out`, `io.weights` (when the case has them), `io.grad.<input>` and
  `io.grad.model.<param>` for every input and parameter, all float32. Boolean masks are
  stored as float32 with 1.0 = blocked (PyTorch's convention for `nn.MultiheadAttention`).

The loss whose gradients are stored is `(out * grad_out).sum()`. Models run in eval mode
(no dropout) with gradients on, so PyTorch takes its reference (non-fused) paths.
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")


def save(name, model, inputs, out, weights=None, extra=None):
    """Backprop (out * grad_out).sum() and write the fixture, in f32 (a reference computed
    in f64 is rounded once, at the end)."""
    g = torch.Generator().manual_seed(1234)
    grad_out = torch.randn(out.shape, generator=g)
    (out * grad_out).sum().backward()
    tensors = {}
    if model is not None:
        for k, v in model.state_dict().items():
            tensors[f"model.{k}"] = v.detach().float().clone().contiguous()
        for k, p in model.named_parameters():
            tensors[f"io.grad.model.{k}"] = p.grad.detach().float().clone().contiguous()
    for k, v in inputs.items():
        tensors[f"io.{k}"] = v.detach().float().clone().contiguous()
        if v.requires_grad:
            tensors[f"io.grad.{k}"] = v.grad.detach().float().clone().contiguous()
    tensors["io.out"] = out.detach().float().clone().contiguous()
    tensors["io.grad_out"] = grad_out
    if weights is not None:
        tensors["io.weights"] = weights.detach().clone().contiguous()
    for k, v in (extra or {}).items():
        tensors[f"io.{k}"] = v.detach().float().clone().contiguous()
    path = os.path.join(OUT, f"{name}.safetensors")
    save_file(tensors, path)
    print(f"{path}: {len(tensors)} tensors")


def leaf(*shape):
    return torch.randn(*shape).requires_grad_(True)


def distinct(module):
    """Every parameter of `module` moved off its initial value (in place): biases that
    PyTorch starts at zero (`in_proj_bias`, `out_proj.bias`, the norms' shifts) and the
    layers a stack deep-copies from one become values of their own, so that importing a
    bias into another's place, or one layer's weights into another, changes the numbers.
    Norm scales stay near 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.05)


def causal_self_attention():
    torch.manual_seed(0)
    B, T, E, H = 2, 6, 16, 4
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():  # non-zero biases, so that the bias import is checked
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    x = leaf(B, T, E)
    blocked = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    out, w = mha(x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False)
    save("mha_causal_self", mha, {"x": x}, out, w)


def cross_attention_kdim_vdim():
    torch.manual_seed(1)
    B, Tq, Tk, E, H, KD, VD = 2, 5, 7, 16, 2, 12, 10
    mha = nn.MultiheadAttention(E, H, bias=False, kdim=KD, vdim=VD, batch_first=True).eval()
    q, k, v = leaf(B, Tq, E), leaf(B, Tk, KD), leaf(B, Tk, VD)
    padding = torch.zeros(B, Tk, dtype=torch.bool)
    padding[0, 5:] = True
    padding[1, 3:] = True
    out, w = mha(q, k, v, key_padding_mask=padding, need_weights=True, average_attn_weights=True)
    save("mha_cross_kdim_vdim", mha, {"query": q, "key": k, "value": v}, out, w,
         extra={"key_padding": padding})


def encoder_layer(name, norm_first, activation, seed):
    torch.manual_seed(seed)
    B, T, E, H, FF = 2, 6, 16, 4, 32
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation=activation,
                                       batch_first=True, norm_first=norm_first).eval()
    distinct(layer)
    x = leaf(B, T, E)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 4:] = True
    out = layer(x, src_key_padding_mask=padding)
    save(name, layer, {"x": x}, out, extra={"key_padding": padding})


def decoder_layer():
    torch.manual_seed(3)
    B, T, S, E, H, FF = 2, 5, 7, 16, 4, 32
    layer = nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True).eval()
    distinct(layer)
    x, memory = leaf(B, T, E), leaf(B, S, E)
    memory_padding = torch.zeros(B, S, dtype=torch.bool)
    memory_padding[0, 6:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    out = layer(x, memory, tgt_mask=causal, tgt_is_causal=True,
                memory_key_padding_mask=memory_padding)
    save("decoder_layer_pre_gelu", layer, {"x": x, "memory": memory}, out,
         extra={"memory_padding": memory_padding})


def encoder_stack():
    """nn.TransformerEncoder of two pre-norm layers with the final norm pre-norm needs,
    causal and with key padding."""
    torch.manual_seed(7)
    B, T, E, H, FF = 2, 6, 16, 4, 32
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    stack = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=False).eval()
    distinct(stack)
    x = leaf(B, T, E)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[0, 5:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    out = stack(x, mask=causal, is_causal=True, src_key_padding_mask=padding)
    save("encoder_stack_pre_gelu", stack, {"x": x}, out, extra={"key_padding": padding})


def sdpa_gqa_bias_scale():
    torch.manual_seed(4)
    B, H, HKV, TQ, TK, D = 2, 4, 2, 5, 6, 8
    q, k, v = leaf(B, H, TQ, D), leaf(B, HKV, TK, D), leaf(B, HKV, TK, D)
    bias = torch.randn(1, H, TQ, TK)
    scale = 0.3
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    # The weights, for the explicit path: SDPA does not return them.
    kr = k.detach().repeat_interleave(H // HKV, dim=1)
    w = torch.softmax(q.detach() @ kr.transpose(-1, -2) * scale + bias, dim=-1)
    save("sdpa_gqa_bias_scale", None, {"q": q, "k": k, "v": v}, out, w, extra={"bias": bias})


def sdpa_fully_blocked_row():
    """Query row 2 of batch 0 sees no key: its output and weights are 0 (as recent
    PyTorch's SDPA gives; nn.MultiheadAttention's weights are NaN, and so was SDPA's
    output in older versions). The reference runs PyTorch without that row and puts
    zeros in its place, so that it holds whatever PyTorch's version."""
    torch.manual_seed(5)
    B, H, T, D = 2, 2, 4, 8
    dead_b, dead_t = 0, 2
    q, k, v = leaf(B, H, T, D), leaf(B, H, T, D), leaf(B, H, T, D)
    blocked = torch.zeros(B, 1, T, T, dtype=torch.bool)
    blocked[1, :, :, 3] = True
    blocked[dead_b, :, dead_t, :] = True
    alive = [t for t in range(T) if t != dead_t]
    g = torch.Generator().manual_seed(1234)
    grad_out = torch.randn(B, H, T, D, generator=g)
    outs, ws = [], []
    for b in range(B):
        rows = alive if b == dead_b else list(range(T))
        qb = q[b:b + 1, :, rows]
        mb = blocked[b:b + 1, :, rows]
        ob = F.scaled_dot_product_attention(qb, k[b:b + 1], v[b:b + 1], attn_mask=~mb)
        wb = torch.softmax((qb @ k[b:b + 1].transpose(-1, -2) / math.sqrt(D)).masked_fill(mb, -math.inf), -1)
        full_o = torch.zeros(1, H, T, D)
        full_w = torch.zeros(1, H, T, T)
        full_o[:, :, rows] = ob
        full_w[:, :, rows] = wb.detach()
        outs.append(full_o)
        ws.append(full_w)
    out = torch.cat(outs)
    (out * grad_out).sum().backward()
    tensors = {f"io.{n}": t.detach().clone() for n, t in (("q", q), ("k", k), ("v", v))}
    tensors.update({f"io.grad.{n}": t.grad.clone() for n, t in (("q", q), ("k", k), ("v", v))})
    tensors["io.blocked"] = blocked.float()
    tensors["io.out"] = out.detach()
    tensors["io.weights"] = torch.cat(ws)
    tensors["io.grad_out"] = grad_out
    path = os.path.join(OUT, "sdpa_fully_blocked_row.safetensors")
    save_file(tensors, path)
    print(f"{path}: {len(tensors)} tensors")


# --- Positions: plain torch code for RoPE, ALiBi, clipped offsets and T5's buckets -----


def alibi_slopes(n):
    """The ALiBi paper's code (github.com/ofirpress/attention_with_linear_biases)."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Hugging Face's T5Attention._relative_position_bucket, as it is."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def rope_half_split(x, theta):
    """Hugging Face's Llama: rotate_half over cos/sin of the doubled frequencies."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_interleaved(x, theta):
    """Meta's Llama: adjacent features as complex numbers, turned by unit phasors."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    phasors = torch.polar(torch.ones_like(freqs), freqs).to(torch.complex64)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], D // 2, 2).contiguous())
    return torch.view_as_real(xc * phasors).flatten(-2)


def positioned_attention(name, kind, seed, **kw):
    """Causal self-attention with the weights of an nn.MultiheadAttention (so that mha's
    import loads them) and positions applied in plain torch: RoPE on the queries and keys
    after the projection, or a bias by distance j - i on the scores. A learned table is a
    parameter of the module, `position_table` `[H, buckets]` indexed by the bucket of
    key - query: the key and layout mha's import reads."""
    torch.manual_seed(seed)
    B, T, E, H = 2, 12, 24, 6
    Dh = E // H
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_(0.0, 0.1)
        mha.out_proj.bias.normal_(0.0, 0.1)
    x = leaf(B, T, E)
    qkv = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    q, k, v = (t.reshape(B, T, H, Dh).transpose(1, 2) for t in qkv.split(E, dim=-1))
    distance = torch.arange(T)[None, :] - torch.arange(T)[:, None]  # key j - query i
    bias = torch.zeros(H, T, T)
    table = None
    if kind == "rope_half_split":
        q, k = rope_half_split(q, kw["theta"]), rope_half_split(k, kw["theta"])
    elif kind == "rope_interleaved":
        q, k = rope_interleaved(q, kw["theta"]), rope_interleaved(k, kw["theta"])
    elif kind == "alibi":
        bias = -torch.tensor(alibi_slopes(H))[:, None, None] * distance.abs()
    elif kind == "clipped":
        m = kw["max"]
        table = nn.Parameter(torch.randn(H, 2 * m + 1) * 0.5)
        bias = table[:, distance.clamp(-m, m) + m]
    elif kind == "t5":
        buckets = t5_bucket(distance, kw["bidirectional"], kw["num_buckets"], kw["max_distance"])
        table = nn.Parameter(torch.randn(H, kw["num_buckets"]) * 0.5)
        bias = table[:, buckets]
    if table is not None:
        mha.register_parameter("position_table", table)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(Dh) + bias
    weights = torch.softmax(scores.masked_fill(causal, -math.inf), dim=-1)
    context = (weights @ v).transpose(1, 2).reshape(B, T, E)
    out = F.linear(context, mha.out_proj.weight, mha.out_proj.bias)
    save(name, mha, {"x": x}, out)


def hf_t5_attention(name, is_decoder, seed):
    """Hugging Face's T5Attention (transformers) with its relative bias, tiny and random:
    the encoder's (bidirectional buckets, key padding) or the decoder's self-attention
    (causal buckets, a causal mask). Its state_dict as transformers names it (`q.weight`,
    `k.weight`, `v.weight`, `o.weight`, `relative_attention_bias.weight` [buckets, heads]),
    its output and the gradients of the input and every parameter. T5 has no biases and
    does not scale its scores; masks are additive, as transformers builds them."""
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(seed)
    B, T, E, H = 2, 12, 24, 6
    config = T5Config(d_model=E, d_kv=E // H, num_heads=H, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, dropout_rate=0.0,
                      is_decoder=is_decoder, attn_implementation="eager")
    attention = T5Attention(config, has_relative_attention_bias=True, layer_idx=0,
                            is_causal=is_decoder).eval()
    x = leaf(B, T, E)
    blocked = torch.zeros(B, 1, T, T, dtype=torch.bool)
    if is_decoder:
        blocked |= torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    else:
        blocked[1, :, :, 9:] = True  # batch row 1: keys 9.. are padding
    mask = torch.zeros(B, 1, T, T).masked_fill(blocked, torch.finfo(torch.float32).min)
    out = attention(x, mask=mask)[0]
    save(name, attention, {"x": x}, out, extra={"key_padding": blocked[:, 0, 0, :]})


def gelu():
    """The exact GELU, `x Φ(x)`, of the feed-forward: values and gradient, over inputs
    spread to its tails (|x| up to 12) and rows of a length that is no multiple of 8."""
    torch.manual_seed(17)
    x = torch.randn(3, 5, 67) * 3
    x[0, 0, :6] = torch.tensor([0.0, -12.0, 12.0, -5.5, 5.5, 1e-4])
    x.requires_grad_(True)
    out = F.gelu(x)
    save("gelu", None, {"x": x}, out)


def layer_norm():
    """`nn.LayerNorm` over rows of 67 (no multiple of 8) far from zero mean and unit
    variance, one row constant (its variance is 0: ε alone; its input gradient is then
    ~300, as large as an f32 tolerance of 1e-4 allows), a learned scale and shift; and a
    norm without shift over rows of 128. Values and gradients of the input and
    the parameters, computed in f64 from f32 inputs: PyTorch's own f32 gradient of the
    scale is 1e-4 off the exact one here (rows whose mean is 30 times their spread)."""
    torch.manual_seed(19)
    for name, d, bias in (("layer_norm", 67, True), ("layer_norm_no_bias", 128, False)):
        norm = nn.LayerNorm(d, eps=1e-5, bias=bias)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d) * 0.5 + 1.0)
            if bias:
                norm.bias.copy_(torch.randn(d) * 0.5)
        x = torch.randn(3, 5, d) * (torch.rand(3, 5, 1) * 3 + 0.5) + torch.randn(3, 5, 1) * 10
        if bias:
            x[1, 2] = 7.25
        norm, x = norm.double(), x.double().requires_grad_(True)
        save(name, norm, {"x": x}, norm(x))


def rms_norm():
    """Hugging Face's `LlamaRMSNorm` (transformers; Mistral's, Qwen2's and Qwen3's are the
    same) over rows of 67 (no multiple of 8) at scales from 0.3 to 3.3 around means up
    to 10, with a learned scale and Llama's epsilon 1e-6: values and gradients of the
    input and the scale. It normalises in f32 (as it does for any input), from f64
    inputs and weights."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(23)
    d = 67
    norm = LlamaRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d) * 0.5 + 1.0)
    x = torch.randn(3, 5, d) * (torch.rand(3, 5, 1) * 3 + 0.3) + torch.randn(3, 5, 1) * 10
    norm, x = norm.double(), x.double().requires_grad_(True)
    save("rms_norm", norm, {"x": x}, norm(x))


def activations():
    """GPT-2's `gelu_new` (transformers' `NewGELUActivation`, GELU's tanh approximation)
    and SiLU (`F.silu`, Llama's `hidden_act`), values and gradients over inputs spread to
    their tails (|x| up to 12), in f64 from f32 inputs."""
    from transformers.activations import NewGELUActivation

    torch.manual_seed(29)
    for name, f in (("gelu_tanh", NewGELUActivation()), ("silu", F.silu)):
        x = torch.randn(3, 5, 67) * 3
        x[0, 0, :6] = torch.tensor([0.0, -12.0, 12.0, -5.5, 5.5, 1e-4])
        x = x.double().requires_grad_(True)
        save(name, None, {"x": x}, f(x))


class GatedFeedForward(nn.Module):
    """Hugging Face's `LlamaMLP` (`down_proj(act(gate_proj(x)) * up_proj(x))`, SiLU) under
    mha's names for its three layers: `linear1` (`gate_proj`), `up` (`up_proj`), `linear2`
    (`down_proj`). The MLP itself is not a submodule, so each weight has one name."""

    def __init__(self, mlp):
        super().__init__()
        self.linear1, self.up, self.linear2 = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        object.__setattr__(self, "mlp", mlp)

    def forward(self, x):
        return self.mlp(x)


def gated_feed_forward():
    """Llama's feed-forward (transformers' `LlamaMLP`: SwiGLU, no biases), width 24 to 40,
    random weights: values and gradients of the input and the three layers, in f64."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(31)
    config = LlamaConfig(
        hidden_size=24, intermediate_size=40, hidden_act="silu", num_attention_heads=4
    )
    model = GatedFeedForward(LlamaMLP(config)).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64).requires_grad_(True)
    save("gated_feed_forward", model, {"x": x}, model(x))


def tiny_llama_config(Config, **overrides):
    """A tiny Llama-family configuration for eager attention: 32 wide, 4 query heads and 2
    key/value heads of 8, RMS norms with epsilon 1e-6, RoPE with theta 500; with
    `overrides`."""
    fields = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
    )
    config = Config(**{**fields, **overrides})
    config._attn_implementation = "eager"
    return config


def additive_mask(B, T, causal, padding=None):
    """The `[B, 1, T, T]` float64 mask transformers' eager attention adds: the float64
    minimum where a key is after the query (when `causal`) or is padding (`padding`
    `[B, T]`, True = padding), 0 elsewhere."""
    blocked = torch.zeros(B, 1, T, T, dtype=torch.bool)
    if causal:
        blocked |= torch.ones(T, T, dtype=torch.bool).triu(1)
    if padding is not None:
        blocked |= padding[:, None, None, :]
    return torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(blocked, torch.finfo(torch.float64).min)


def write_config(name, config):
    """The configuration of fixture `name` beside it, as `<name>.json`."""
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        f.write(config.to_json_string())


def hf_attention(name, family, seed):
    """The attention of Hugging Face's Qwen2 (biases on q, k and v, none on o) or Qwen3
    (an RMS norm over each head's queries and keys before RoPE, no biases), transformers'
    own module, tiny and random: 4 query heads and 2 key/value heads of 8, RoPE with
    theta 500, causal, eager attention. Values and gradients of the input and of every
    parameter, in f64 (the norms normalise in f32, as they do for any input)."""
    if family == "qwen2":
        from transformers import Qwen2Config as Config
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention as Attention
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rotary
    else:
        from transformers import Qwen3Config as Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as Attention
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary

    torch.manual_seed(seed)
    config = tiny_llama_config(Config)
    attention = Attention(config, layer_idx=0)
    with torch.no_grad():
        for p in attention.parameters():
            if p.dim() == 1:  # the biases and the norms' scales, zeros and ones at first
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.numel() == 8 else 0.0))
    attention = attention.double()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64).requires_grad_(True)
    positions = torch.arange(T)[None].expand(B, -1)
    cos, sin = Rotary(config)(x, positions)
    mask = additive_mask(B, T, causal=True)
    out = attention(x, (cos, sin), mask)[0]
    save(name, attention, {"x": x}, out)


def sdpa_sinks():
    """transformers' gpt-oss eager attention (`eager_attention_forward`, the reference of
    its attention sinks) on raw queries, keys and values: 4 query heads and 2 key/value
    heads of 8, 9 positions, a causal window of 4 keys, the last two keys of batch row 1
    padding and query 3 of batch row 0 seeing no key; random sinks. Values, weights (the
    sink's column dropped, as transformers returns them) and the gradients of the query,
    key, value and sinks, in f64. `io.blocked` holds the padding and the blind row only:
    the window is the mask's rule."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(53)
    B, H, HKV, T, D = 2, 4, 2, 9, 8

    class Sinks(nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = nn.Parameter(torch.randn(H, dtype=torch.float64) * 1.5)
            self.num_key_value_groups = H // HKV

    module = Sinks().eval()
    q = torch.randn(B, H, T, D, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(B, HKV, T, D, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(B, HKV, T, D, dtype=torch.float64).requires_grad_(True)
    blocked = torch.zeros(B, 1, T, T, dtype=torch.bool)
    blocked[1, :, :, 7:] = True
    blocked[0, :, 3, :] = True
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    window = (j > i) | (j <= i - 4)
    mask = torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(
        blocked | window, torch.finfo(torch.float64).min)
    out, w = eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
    out = out.transpose(1, 2)  # transformers returns [B, T, H, D]
    save("sdpa_sinks", module, {"q": q, "k": k, "v": v}, out, w.detach().float(),
         extra={"blocked": blocked})


def gpt_oss_attention():
    """The attention of Hugging Face's gpt-oss, transformers' own `GptOssAttention`, tiny
    and random: 32 wide, 4 query heads and 2 key/value heads of 8, biases on every
    projection, attention sinks, a sliding window of 4 (`layer_types`), RoPE with theta
    500 (default RoPE: the released models' YaRN scaling is not among what loads), eager
    attention, the last two keys of batch row 1 padding. Values and gradients of the
    input and of every parameter (the sinks included), in f64."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    torch.manual_seed(54)
    config = tiny_llama_config(
        GptOssConfig,
        num_hidden_layers=1,
        sliding_window=4,
        layer_types=["sliding_attention"],
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    attention = GptOssAttention(config, layer_idx=0)
    with torch.no_grad():
        for p in attention.parameters():
            if p.dim() == 1:  # the biases and the sinks
                p.copy_(torch.randn(p.shape) * (1.5 if p.numel() == 4 else 0.3))
    attention = attention.double()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64).requires_grad_(True)
    positions = torch.arange(T)[None].expand(B, -1)
    cos, sin = GptOssRotaryEmbedding(config)(x, positions)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 7:] = True
    mask = additive_mask(B, T, causal=True, padding=padding)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = mask.masked_fill(j <= i - 4, torch.finfo(torch.float64).min)
    out = attention(x, (cos, sin), mask)[0]
    save("gpt_oss_attention", attention, {"x": x}, out, extra={"key_padding": padding})


def hf_decoder_layer(name, family, seed, head_dim=8):
    """A decoder layer of Hugging Face's Llama, Mistral, Qwen2 or Qwen3, transformers' own
    module built from a tiny random configuration offline (32 wide, 4 query heads and 2
    key/value heads of `head_dim` (Qwen3's 16: heads wider than hidden_size /
    num_attention_heads, as in its released models), feed-forward 48, RoPE with theta 500, RMS norms with random
    scales), causal with the last two keys of batch row 1 padding, eager attention.
    Values and gradients of the input and of every parameter, in f64; the configuration
    is written beside the fixture as `<name>.json`, as `save_pretrained` writes it."""
    import importlib
    import json

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    Config = getattr(importlib.import_module("transformers"), f"{prefix}Config")
    torch.manual_seed(seed)
    config = tiny_llama_config(
        Config,
        intermediate_size=48,
        num_hidden_layers=1,
        head_dim=head_dim,
        vocab_size=50,
        sliding_window=None,
    )
    layer = getattr(module, f"{prefix}DecoderLayer")(config, layer_idx=0)
    with torch.no_grad():
        for key, p in layer.named_parameters():
            if p.dim() == 1:  # norms' scales (ones at first) and Qwen2's biases (zeros)
                p.copy_(torch.randn(p.shape) * 0.3 + (0.0 if key.endswith("bias") else 1.0))
    layer = layer.double()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64).requires_grad_(True)
    positions = torch.arange(T)[None].expand(B, -1)
    cos, sin = getattr(module, f"{prefix}RotaryEmbedding")(config)(x, positions)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 7:] = True
    mask = additive_mask(B, T, causal=True, padding=padding)
    out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
    out = out[0] if isinstance(out, tuple) else out
    save(name, layer, {"x": x}, out, extra={"key_padding": padding})
    write_config(name, config)


def hf_causal_lm(name, family, seed, tied, head_dim=8, window=None):
    """A 2-layer `LlamaForCausalLM` or `Qwen3ForCausalLM` (transformers' own model from a
    tiny random configuration, offline: 32 wide, 4 query heads and 2 key/value heads of
    `head_dim` (Qwen3's 16), Mistral's sliding window of 4 when `window`, feed-forward 48, a vocabulary of 50, RoPE with theta 500; the head tied to the
    embedding when `tied`), eager attention: the logits of two sequences of 9 tokens and
    the gradients of every parameter, in f64; the configuration beside it as
    `<name>.json`."""
    import importlib

    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen3": "Qwen3"}[family]
    transformers = importlib.import_module("transformers")
    torch.manual_seed(seed)
    config = tiny_llama_config(
        getattr(transformers, f"{prefix}Config"),
        intermediate_size=48,
        num_hidden_layers=2,
        head_dim=head_dim,
        vocab_size=50,
        tie_word_embeddings=tied,
        sliding_window=window,
    )
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.dim() == 1:  # the norms' scales, ones at first
                p.copy_(torch.randn(p.shape) * 0.3 + 1.0)
    model = model.double().eval()
    ids = torch.randint(0, 50, (2, 9))
    out = model(input_ids=ids).logits
    save(name, model, {"ids": ids}, out)
    write_config(name, config)


def hf_tiny_llama():
    """A whole Hugging Face model directory for `examples/hf`: a 2-layer `LlamaForCausalLM`
    (32 wide, 4 query heads and 2 key/value heads of 8, feed-forward 48, RoPE with theta
    500, weights drawn wider than transformers' 0.02 so that greedy decoding has clear
    winners) saved with `save_pretrained` (f32 `model.safetensors`, `config.json`), a
    byte-level BPE `tokenizer.json` of 300 tokens trained here on a few sentences (`<s>`
    prepended, `</s>` ends), and `expected.json`: a prompt, its token ids, and the tokens
    transformers' `generate` gives greedily with the text they add to the prompt's (the margin between the two most
    likely tokens of every step is checked to be at least 1e-2, so that rounding cannot
    swap them)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out = os.path.join(OUT, "hf_tiny_llama")
    os.makedirs(out, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Attention is all you need, and a cache of keys and values.",
        "Burn is a deep learning framework written in Rust.",
        "Once upon a time there was a tiny model that spoke in tokens.",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    vocab = tokenizer.get_vocab_size()
    prompt = "Once upon a time the fox"
    ids = tokenizer.encode(prompt).ids
    for seed in range(60, 100):
        torch.manual_seed(seed)
        config = LlamaConfig(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48, num_hidden_layers=2, vocab_size=vocab, rms_norm_eps=1e-6,
            rope_theta=500.0, initializer_range=0.3, tie_word_embeddings=False,
            bos_token_id=tokenizer.token_to_id("<s>"), eos_token_id=tokenizer.token_to_id("</s>"),
            max_position_embeddings=128)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=config.eos_token_id)
        margins = [s[0].topk(2).values for s in generated.scores]
        if min(float(m[0] - m[1]) for m in margins) >= 1e-2:
            break
    else:
        sys.exit("hf_tiny_llama: no seed gave clear winners")
    new = generated.sequences[0, len(ids):].tolist()
    # The text the new tokens add after the prompt, decoded together with it.
    before = tokenizer.decode(ids, skip_special_tokens=True)
    after = tokenizer.decode(ids + new, skip_special_tokens=True)
    assert after.startswith(before)
    added = after[len(before):]
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    for extra in ("generation_config.json",):
        path = os.path.join(out, extra)
        if os.path.exists(path):
            os.remove(path)
    expected = {
        "prompt": prompt,
        "prompt_ids": ids,
        "tokens": 24,
        "generated_ids": new,
        "text": added,
        "seed": seed,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"{out}: seed {seed}, generated {new}")


def hf_gpt2_bert(name, family, seed):
    """GPT-2's block (`GPT2Block`: causal, pre-norm, packed `c_attn` in Conv1D layout,
    `gelu_new`) or BERT's layer (`BertLayer`: bidirectional, post-norm, exact GELU),
    transformers' own modules from tiny random configurations offline (32 wide, 4 heads,
    feed-forward 48, random norm scales and biases), the last two keys of batch row 1
    padding, eager attention: values and gradients of the input and every parameter, in
    f64; the configuration beside it as `<name>.json`."""
    import transformers

    torch.manual_seed(seed)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_head=4, n_layer=1, n_inner=48, vocab_size=50, n_positions=16,
            bos_token_id=0, eos_token_id=0,
        )
        config._attn_implementation = "eager"
        layer = transformers.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0)
    else:
        config = transformers.BertConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
            vocab_size=50, layer_norm_eps=1e-12,
        )
        config._attn_implementation = "eager"
        layer = transformers.models.bert.modeling_bert.BertLayer(config)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.numel() == 32 else 0.0))
    layer = layer.double().eval()
    B, T = 2, 9
    x = torch.randn(B, T, 32, dtype=torch.float64).requires_grad_(True)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, 7:] = True
    mask = additive_mask(B, T, causal=family == "gpt2", padding=padding)
    out = layer(x, attention_mask=mask)
    out = out[0] if isinstance(out, tuple) else out
    save(name, layer, {"x": x}, out, extra={"key_padding": padding})
    write_config(name, config)


def gpt2_lm():
    """A 2-layer `GPT2LMHeadModel` (transformers' own, a tiny random configuration
    offline: 32 wide, 4 heads, 16 learned positions, a vocabulary of 50, the head tied to
    the token embedding), eager attention: the logits of two sequences of 9 tokens and
    the gradients of every parameter, in f64; the configuration beside it as
    `gpt2_lm.json`."""
    import transformers

    torch.manual_seed(51)
    config = transformers.GPT2Config(
        n_embd=32, n_head=4, n_layer=2, n_inner=48, vocab_size=50, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.numel() == 32 else 0.0))
    model = model.double().eval()
    ids = torch.randint(0, 50, (2, 9))
    out = model(input_ids=ids).logits
    save("gpt2_lm", model, {"ids": ids}, out)
    write_config("gpt2_lm", config)


def bert_model():
    """A 2-layer `BertModel` (transformers' own, a tiny random configuration offline: 32
    wide, 4 heads, feed-forward 48, 16 positions, two token types, random norm scales),
    without its pooler, eager attention: the last hidden state of two sequences of 9
    tokens, two segments, the last two keys of the second padding, the padding token (0)
    at two attended places, whose embedding row the lookup gives no gradient; the
    gradients of every parameter, in f64; the configuration beside it as
    `bert_model.json`."""
    import transformers

    torch.manual_seed(53)
    config = transformers.BertConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
        vocab_size=50, max_position_embeddings=16, layer_norm_eps=1e-12,
    )
    config._attn_implementation = "eager"
    model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.3 + (1.0 if p.numel() == 32 else 0.0))
    model = model.double().eval()
    ids = torch.randint(0, 50, (2, 9))
    ids[0, 2] = ids[1, 4] = config.pad_token_id
    types = torch.zeros(2, 9, dtype=torch.long)
    types[:, 5:] = 1
    attending = torch.ones(2, 9, dtype=torch.long)
    attending[1, 7:] = 0
    out = model(input_ids=ids, token_type_ids=types, attention_mask=attending).last_hidden_state
    save("bert_model", model, {"ids": ids, "types": types}, out, extra={"key_padding": attending == 0})
    write_config("bert_model", config)


def cross_entropy():
    """`F.cross_entropy` with `ignore_index` over 37 rows of 13 classes (logits spread to
    ±15, a few rows ignored): the loss and its gradient with respect to the logits."""
    torch.manual_seed(23)
    logits = (torch.randn(37, 13) * 5).requires_grad_(True)
    targets = torch.randint(1, 13, (37,))
    targets[[0, 5, 6, 30]] = 0
    loss = F.cross_entropy(logits, targets, ignore_index=0).reshape(1)
    save("cross_entropy", None, {"logits": logits}, loss, extra={"targets": targets})


def cross_entropy_options():
    """`F.cross_entropy` with PyTorch's other arguments, over 23 rows of 7 classes (rows 3
    and 11 ignored, at -100): `io.<case>.out` and `io.<case>.grad.logits` for the random
    upstream gradient `io.<case>.grad_out` of each case, the class weights `io.weight`."""
    torch.manual_seed(29)
    logits = torch.randn(23, 7) * 4
    targets = torch.randint(0, 7, (23,))
    targets[[3, 11]] = -100
    weight = torch.rand(7) + 0.2
    cases = {
        "smooth": dict(label_smoothing=0.1),
        "weight": dict(weight=weight),
        "weight_smooth": dict(weight=weight, label_smoothing=0.25),
        "sum": dict(label_smoothing=0.1, reduction="sum"),
        "none": dict(weight=weight, label_smoothing=0.1, reduction="none"),
        "plain_sum": dict(reduction="sum"),
    }
    g = torch.Generator().manual_seed(1234)
    tensors = {"io.logits": logits, "io.targets": targets.float(), "io.weight": weight}
    for name, kw in cases.items():
        x = logits.clone().requires_grad_(True)
        out = F.cross_entropy(x, targets, ignore_index=-100, **kw).reshape(-1)
        grad_out = torch.randn(out.shape, generator=g)
        (out * grad_out).sum().backward()
        tensors[f"io.{name}.out"] = out.detach().clone()
        tensors[f"io.{name}.grad_out"] = grad_out
        tensors[f"io.{name}.grad.logits"] = x.grad.detach().clone()
    path = os.path.join(OUT, "cross_entropy_options.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    print(f"{path}: {len(tensors)} tensors")


def position_tables():
    """What positions are made of, to compare exactly: T5's bucket of every distance in
    -300..=300 for four configurations, sinusoids, ALiBi's slopes for 1..=16 heads."""
    distance = torch.arange(-300, 301)
    tensors = {}
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 20)):
            key = f"io.t5.{'bi' if bidirectional else 'causal'}.{nb}.{md}"
            tensors[key] = t5_bucket(distance, bidirectional, nb, md).float()
    # "Attention Is All You Need": sin at even features, cos at odd, positions 3..10.
    d_model, positions = 10, torch.arange(3, 10, dtype=torch.float64)[:, None]
    angle = positions / 10000 ** ((torch.arange(d_model) // 2 * 2).double() / d_model)
    tensors["io.sinusoids"] = torch.where(torch.arange(d_model) % 2 == 0, angle.sin(), angle.cos()).float()
    for h in range(1, 17):
        tensors[f"io.alibi.{h}"] = torch.tensor(alibi_slopes(h), dtype=torch.float32)
    path = os.path.join(OUT, "position_tables.safetensors")
    save_file(tensors, path)
    print(f"{path}: {len(tensors)} tensors")


def half_precision(name, dtype, seed):
    """nn.MultiheadAttention run in half precision as a user runs it: the module cast with
    `.to(dtype)`, its state_dict stored in that dtype, the input rounded to it, causal
    self-attention computed by PyTorch's CPU kernels in it (`io.out`, in the dtype). Beside
    it `io.exact`: the same rounded weights and input computed in f64 (stored as f32), to
    tell PyTorch's own rounding from ours."""
    torch.manual_seed(seed)
    B, T, E, H = 2, 12, 32, 4
    mha = nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_(0.0, 0.1)
        mha.out_proj.bias.normal_(0.0, 0.1)
    mha = mha.to(dtype)
    x = torch.randn(B, T, E).to(dtype)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    with torch.no_grad():
        out, _ = mha(x, x, x, attn_mask=causal, need_weights=False)
        exact, _ = mha.double()(x.double(), x.double(), x.double(), attn_mask=causal,
                                need_weights=False)
    tensors = {f"model.{k}": v.to(dtype).contiguous() for k, v in mha.state_dict().items()}
    tensors["io.x"] = x.contiguous()
    tensors["io.out"] = out.contiguous()
    tensors["io.exact"] = exact.float().contiguous()
    assert all(v.dtype == dtype for k, v in tensors.items() if k != "io.exact")
    path = os.path.join(OUT, f"{name}.safetensors")
    save_file(tensors, path)
    print(f"{path}: {len(tensors)} tensors")


# Every fixture by name; `python3 scripts/golden.py NAME...` writes only those named.
FIXTURES = {
    "mha_causal_self": causal_self_attention,
    "mha_cross_kdim_vdim": cross_attention_kdim_vdim,
    "encoder_layer_pre_gelu": lambda: encoder_layer("encoder_layer_pre_gelu", True, "gelu", 2),
    "encoder_layer_post_relu": lambda: encoder_layer("encoder_layer_post_relu", False, "relu", 6),
    "decoder_layer_pre_gelu": decoder_layer,
    "encoder_stack_pre_gelu": encoder_stack,
    "sdpa_gqa_bias_scale": sdpa_gqa_bias_scale,
    "sdpa_fully_blocked_row": sdpa_fully_blocked_row,
    "mha_rope_half_split": lambda: positioned_attention(
        "mha_rope_half_split", "rope_half_split", 11, theta=10000.0),
    "mha_rope_interleaved": lambda: positioned_attention(
        "mha_rope_interleaved", "rope_interleaved", 12, theta=500.0),
    "mha_alibi": lambda: positioned_attention("mha_alibi", "alibi", 13),
    "mha_relative_clipped": lambda: positioned_attention("mha_relative_clipped", "clipped", 14, max=4),
    "mha_t5_bidirectional": lambda: positioned_attention(
        "mha_t5_bidirectional", "t5", 15, bidirectional=True, num_buckets=8, max_distance=20),
    "mha_t5_causal": lambda: positioned_attention(
        "mha_t5_causal", "t5", 16, bidirectional=False, num_buckets=8, max_distance=20),
    "position_tables": position_tables,
    "gelu": gelu,
    "layer_norm": layer_norm,  # and layer_norm_no_bias
    "rms_norm": rms_norm,
    "activations": activations,  # gelu_tanh and silu
    "gated_feed_forward": gated_feed_forward,
    "qwen2_attention": lambda: hf_attention("qwen2_attention", "qwen2", 37),
    "qwen3_attention": lambda: hf_attention("qwen3_attention", "qwen3", 38),
    "sdpa_sinks": sdpa_sinks,
    "gpt_oss_attention": gpt_oss_attention,
    "llama_layer": lambda: hf_decoder_layer("llama_layer", "llama", 43),
    "mistral_layer": lambda: hf_decoder_layer("mistral_layer", "mistral", 44),
    "qwen2_layer": lambda: hf_decoder_layer("qwen2_layer", "qwen2", 45),
    "qwen3_layer": lambda: hf_decoder_layer("qwen3_layer", "qwen3", 46, head_dim=16),
    "gpt2_block": lambda: hf_gpt2_bert("gpt2_block", "gpt2", 49),
    "bert_layer": lambda: hf_gpt2_bert("bert_layer", "bert", 50),
    "gpt2_lm": gpt2_lm,
    "bert_model": bert_model,
    "mistral_lm": lambda: hf_causal_lm("mistral_lm", "mistral", 52, tied=False, window=4),
    "llama_lm": lambda: hf_causal_lm("llama_lm", "llama", 47, tied=False),
    "qwen3_lm": lambda: hf_causal_lm("qwen3_lm", "qwen3", 48, tied=True, head_dim=16),
    "hf_tiny_llama": hf_tiny_llama,
    "cross_entropy": cross_entropy,
    "cross_entropy_options": cross_entropy_options,
    "mha_t5_hf_encoder": lambda: hf_t5_attention("mha_t5_hf_encoder", False, 41),
    "mha_t5_hf_decoder": lambda: hf_t5_attention("mha_t5_hf_decoder", True, 42),
    "mha_bf16": lambda: half_precision("mha_bf16", torch.bfloat16, 31),
    "mha_f16": lambda: half_precision("mha_f16", torch.float16, 32),
}


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    names = sys.argv[1:] or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        sys.exit(f"unknown fixtures {unknown}; known: {', '.join(FIXTURES)}")
    for name in names:
        FIXTURES[name]()
