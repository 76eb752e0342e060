#!/usr/bin/env python3
"""The PyTorch reference for character-level language modelling: nanoGPT's model and
recipe on the corpus, split, batches and validation windows of the trainer's
`examples/train/src/corpus.rs`, for comparing quality and wall time with the trainer's
text task (`train --task text`) on the same machine.

The model is nanoGPT's GPT: token and learned position embeddings, pre-norm blocks
(LayerNorm, causal self-attention with a fused QKV projection, a GELU MLP of 4x width),
a final LayerNorm and a head tied to the token embedding, with biases in the linear
layers and norms (nanoGPT's model default, `bias=True`; its train.py turns them off);
weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 layers)), biases 0. The
recipe: AdamW (betas 0.9/0.99, weight decay 0.1 on the matrices and embeddings, none on
biases and norms), a linear warmup of 100 steps to the learning rate, a cosine decay to a
tenth of it after the last step (nanoGPT's), gradient clipping at norm 1.

The data are the trainer's (examples/train/src/corpus.rs): the vocabulary is the corpus's
distinct characters, sorted; the first (9 n + 5) // 10 characters train, the rest validate;
a step's batch is the windows of block + 1 characters starting at `batch_start(seed,
step, row)` (SplitMix64, below); validation is the mean loss over a fixed set of
windows spread evenly over the validation split, every --eval-every steps and at the end.

    python3 scripts/train_pytorch_text.py --threads 2                    # the CPU recipe
    python3 scripts/train_pytorch_text.py --preset gpu --device cuda     # nanoGPT's GPU one
    python3 scripts/train_pytorch_text.py --threads 2 --preset gpu --steps 20   # its step time

Prints a line per evaluation and a summary (losses in nats per character, and bits);
--json writes the summary.
"""

import argparse
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "examples", "train", "data", "shakespeare.txt")
MASK = (1 << 64) - 1

# (layers, heads, width, block, batch, steps, lr, dropout): nanoGPT's shakespeare_char
# recipes, the CPU one from its README, the GPU one from config/train_shakespeare_char.py.
PRESETS = {
    "cpu": (4, 4, 128, 64, 12, 2000, 1e-3, 0.0),
    "gpu": (6, 6, 384, 256, 64, 5000, 1e-3, 0.2),
}
WARMUP = 100


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def batch_start(seed, step, row, windows):
    """Where row `row` of step `step`'s batch starts: as `corpus::batch_start` in Rust."""
    h = splitmix64(seed & MASK)
    h = splitmix64(h ^ step)
    h = splitmix64(h ^ row)
    return h % windows


def valid_starts(count, windows):
    """`count` window starts spread evenly over the validation split, first and last
    included: as `corpus::valid_starts` in Rust."""
    if count <= 1 or windows <= 1:
        return [0] * min(count, windows)
    return [i * (windows - 1) // (count - 1) for i in range(count)]


class Block(nn.Module):
    def __init__(self, width, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.attn_proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, width, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block_ in self.blocks:
            for proj in (block_.attn_proj, block_.mlp_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, ids, targets):
        t = ids.shape[1]
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(t, device=ids.device)))
        for block_ in self.blocks:
            x = block_(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step, lr, steps):
    """nanoGPT's schedule: linear warmup, then cosine to lr / 10 at the last step."""
    if step < WARMUP:
        return lr * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return lr / 10 + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - lr / 10)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    parser.add_argument("--data", default=CORPUS, help="a UTF-8 text (default: the Shakespeare corpus)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between validations")
    parser.add_argument("--valid-windows", type=int, default=1024, help="fixed validation windows")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    layers, heads, width, block, batch, steps, lr, dropout = PRESETS[args.preset]
    steps = args.steps or steps
    if args.eval_every < 1 or args.valid_windows < 1:
        parser.error("--eval-every and --valid-windows must be at least 1")
    with open(args.data, encoding="utf-8", newline="") as f:  # no newline translation
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = (9 * len(ids) + 5) // 10
    train, valid = ids[:split], ids[split:]
    train_windows, valid_windows = len(train) - block, len(valid) - block
    assert train_windows > 0 and valid_windows > 0, "the text is too short for the block size"
    starts = valid_starts(args.valid_windows, valid_windows)
    valid_batches = [
        torch.stack([valid[s : s + block + 1] for s in starts[i : i + 64]]).to(device)
        for i in range(0, len(starts), 64)
    ]

    model = GPT(len(vocab), block, layers, heads, width, dropout).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.99),
    )
    params = sum(p.numel() for p in model.parameters())

    @torch.no_grad()
    def validate():
        model.eval()
        total, count = 0.0, 0
        for windows in valid_batches:
            total += model(windows[:, :-1], windows[:, 1:]).item() * len(windows)
            count += len(windows)
        model.train()
        return total / count

    print(
        f"nanoGPT reference ({args.preset}): {layers} layers, {heads} heads, width {width}, "
        f"block {block}, batch {batch}, {steps} steps, {params / 1e6:.2f} M parameters, "
        f"vocabulary {len(vocab)}, {len(train)} training and {len(valid)} validation characters, "
        f"{args.threads} threads on {args.device}"
    )
    started = time.perf_counter()
    curve, recent, validating = [], [], 0.0
    for step in range(steps):
        rows = [batch_start(args.seed, step, r, train_windows) for r in range(batch)]
        windows = torch.stack([train[s : s + block + 1] for s in rows]).to(device)
        for group in optim.param_groups:
            group["lr"] = lr_at(step, lr, steps)
        loss = model(windows[:, :-1], windows[:, 1:])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        recent.append(loss.item())
        done = step + 1
        if done % args.eval_every == 0 or done == steps:
            valid_started = time.perf_counter()
            valid_loss = validate()
            validating += time.perf_counter() - valid_started
            train_loss = sum(recent) / len(recent)
            recent = []
            curve.append({"step": done, "train_loss": train_loss, "valid_loss": valid_loss})
            print(
                f"step {done}/{steps}: train loss {train_loss:.4f}, valid loss {valid_loss:.4f} "
                f"({valid_loss / math.log(2):.3f} bits/char), {time.perf_counter() - started:.1f} s"
            )
    wall = time.perf_counter() - started
    final = curve[-1]["valid_loss"]
    summary = {
        "preset": args.preset,
        "seed": args.seed,
        "steps": steps,
        "threads": args.threads,
        "device": args.device,
        "parameters": params,
        "final_valid_loss": final,
        "final_valid_bits_per_char": final / math.log(2),
        "wall_seconds": wall,
        "validation_seconds": validating,
        "ms_per_step": 1e3 * (wall - validating) / steps,
        "tokens_per_second": steps * batch * block / (wall - validating),
        "curve": curve,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    print(
        f"final valid loss {final:.4f} nats/char ({final / math.log(2):.3f} bits/char); "
        f"{wall:.1f} s with {validating:.1f} s of validation; training {summary['ms_per_step']:.1f} "
        f"ms/step, {summary['tokens_per_second']:.0f} tokens/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
