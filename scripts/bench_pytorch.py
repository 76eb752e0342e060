#!/usr/bin/env python3
"""Times PyTorch at the shapes of `cargo run --release -p bench`, for side-by-side tables.

Causal self-attention with `torch.nn.MultiheadAttention` (batch_first, dropout 0, no
weights returned, `is_causal=True` with its mask), forward (under `torch.inference_mode`)
and forward+backward (`out.sum().backward()`, the input requiring grad), and the core
`torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`. Each number
is the median of --runs runs after a warm-up (two runs, then more for half a second
where they are short); CUDA is synchronised after each run. With --queued, each call
of under 2 s is also timed queued, as the Rust benchmark's --queued does: --runs
batches of calls issued back to back before one synchronisation, enough to keep the
device busy for 25 ms (2 to 64 calls), the median per call (`queued_ms` and
`queued_calls` in the JSON).
GFLOP/s count the same work as the Rust benchmark: `8·B·T·D²` for the projections and
`2·B·T²·D` for the causal attention products, forward; a backward counts twice the forward.

    python3 scripts/bench_pytorch.py                    # CPU, every thread
    python3 scripts/bench_pytorch.py --threads 2 --json pytorch.json
    python3 scripts/bench_pytorch.py --device cuda
    python3 scripts/bench_pytorch.py --trainer --threads 2   # whole training steps

`--trainer` times whole training steps of the trainer's decoder-only model built the same
way in PyTorch (token embedding plus sinusoidal positions, pre-norm causal
`nn.TransformerEncoderLayer`s with GELU and no dropout, a final LayerNorm, a linear head;
cross-entropy over the output tokens, backward, clipping of the gradient norm at 1, AdamW
with weight decay 0.01; the norm clipped is all the gradients' together, where the
trainer's synthetic tasks clip each parameter's, a few small reductions either way) on
batches of 64 reversals of 8 to 16 symbols (10 symbols), right
padded to the longest of each batch, a fresh batch per step: at the trainer's default
size (d_model 64, 2 layers, 4 heads, feed-forward 256) and at the reference size
(d_model 128, 3 layers, 4 heads, feed-forward 512), like `cargo run --release -p bench --
--shapes none` (its `trainer` and `trainer-reference` lines). Tokens per second count the
real tokens of each batch (`input SEP output EOS`), as the Rust benchmark does.
"""

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "tiny": (2, 16, 32, 4),
    "small": (32, 128, 256, 8),
    "base": (8, 512, 512, 8),
    "long": (1, 4096, 512, 8),
}


def mha_flops(b, t, d):
    return 8 * b * t * d * d + core_flops(b, t, d)


def core_flops(b, t, d):
    return 2 * b * t * t * d


# Seconds of untimed runs before a measurement, past the first two: as the Rust
# benchmark's `WARM_UP`, so that a device that sat idle is at its clocks.
WARM_UP = 0.5

# As the Rust benchmark's `QUEUE_SPAN_MS` and `QUEUE_CALLS`: a queued batch keeps the
# device busy for this many milliseconds at the synced time, in 2 to 64 calls.
QUEUE_SPAN_MS = 25.0
QUEUE_CALLS = (2, 64)
# The longest synced call also timed queued, as the Rust benchmark's.
QUEUE_MOST_MS = 2000.0

# Whether `timed` also times calls queued (--queued).
QUEUE = False


def queue_calls(ms):
    """Calls of one queued batch of a call that takes `ms` synced."""
    fewest, most = QUEUE_CALLS
    return most if ms <= 0 else min(max(math.ceil(QUEUE_SPAN_MS / ms), fewest), most)


def timed(runs, device, f, queue=None):
    """Median milliseconds of f over `runs` runs after a warm-up: two runs, then more for
    WARM_UP seconds where the second took under 2 s (else at most 3 timed runs); with
    the runs, and where `queue` (QUEUE unless given) asks, `queued`'s."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    f()
    sync()
    start = time.perf_counter()
    f()
    sync()
    slow = time.perf_counter() - start > 2.0
    if slow:
        runs = min(runs, 3)
    else:
        start = time.perf_counter()
        while time.perf_counter() - start < WARM_UP:
            f()
            sync()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(samples)
    return ms, runs, queued(ms, runs, device, f) if (QUEUE if queue is None else queue) else None


def queued(ms, runs, device, f):
    """Where the synced median `ms` is at most QUEUE_MOST_MS, the median milliseconds per
    call of `runs` batches of `queue_calls` calls before one sync and those calls (else
    None), on a device already warm."""
    if ms > QUEUE_MOST_MS:
        return None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls = queue_calls(ms)
    batches = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        sync()
        batches.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(batches), calls


def times(result):
    """The JSON fields of `timed`'s result."""
    ms, n, queued = result
    fields = dict(median_ms=ms, runs=n)
    if queued:
        fields.update(queued_ms=queued[0], queued_calls=queued[1])
    return fields


DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def bench(shape_name, device, runs, dtype="f32"):
    b, t, d, h = SHAPES[shape_name]
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    mha = torch.nn.MultiheadAttention(d, h, dropout=0.0, batch_first=True).to(device, dt)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=device, dtype=torch.bool)
    x = torch.randn(b, t, d, device=device, dtype=dt)
    records = []

    def record(subject, pass_, result, flops):
        records.append(
            dict(shape=shape_name, dtype=dtype, subject=subject, pass_=pass_, **times(result),
                 gflops=flops / result[0] / 1e6)
        )

    def forward():
        with torch.inference_mode():
            mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)

    xg = x.clone().requires_grad_()

    def forward_backward():
        # Fresh gradients each call, as `mha`'s (no accumulation into the last call's).
        mha.zero_grad(set_to_none=True)
        xg.grad = None
        out, _ = mha(xg, xg, xg, attn_mask=mask, is_causal=True, need_weights=False)
        out.sum().backward()

    fwd = mha_flops(b, t, d)
    record("pytorch", "forward", timed(runs, device, forward), fwd)
    record("pytorch", "forward+backward", timed(runs, device, forward_backward), 3 * fwd)

    q, k, v = (torch.randn(b, h, t, d // h, device=device, dtype=dt) for _ in range(3))

    def core_forward():
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    qg, kg, vg = (a.clone().requires_grad_() for a in (q, k, v))

    def core_forward_backward():
        qg.grad = kg.grad = vg.grad = None
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()

    core = core_flops(b, t, d)
    record("pytorch-core", "forward", timed(runs, device, core_forward), core)
    record("pytorch-core", "forward+backward", timed(runs, device, core_forward_backward), 3 * core)
    return records


def bench_long_core(seq, device, runs, dtype):
    """The causal core alone at `seq` positions (batch 1, 8 heads of 64), forward+backward,
    with the peak memory: what PyTorch's caching allocator reserved from CUDA, as `mha`'s
    figure is its memory pool's pages (and what its tensors took of it, `peak_allocated_mib`)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, seq, 64, device=device, dtype=DTYPES[dtype], requires_grad=True) for _ in range(3))

    def forward_backward():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    if device.type == "cuda":
        # What the caching allocator kept of the measurements before this one is not this
        # one's: handed back first, so that the peak is this call's alone. cuBLAS's
        # workspaces (kept by the linear layers' products) are in the allocator too, and
        # `empty_cache` leaves them: cleared first where this PyTorch can.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ms, n, _ = timed(min(runs, 3), device, forward_backward, queue=False)
    # The peak before the queued batches.
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_reserved() / 2**20 if cuda else None
    allocated = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    result = (ms, n, queued(ms, n, device, forward_backward) if QUEUE else None)
    flops = 3 * core_flops(1, seq, 512)
    return dict(shape="long-core", dtype=dtype, subject="pytorch-core", pass_="forward+backward",
                context=seq, **times(result), gflops=flops / result[0] / 1e6, peak_mib=peak,
                peak_allocated_mib=allocated)


# The trainer's vocabulary: PAD, SEP, EOS, then the symbols.
PAD, SEP, EOS, FIRST = 0, 1, 2, 3
TRAINER_SIZES = {
    # name: (d_model, layers, heads, learning rate)
    "default": (64, 2, 4, 3e-3),
    "reference": (128, 3, 4, 1e-3),
}


class Decoder(torch.nn.Module):
    """The trainer's decoder-only model (examples/train/src/model.rs), in PyTorch."""

    def __init__(self, vocab, d_model, layers, heads):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, norm=torch.nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)
        self.d_model = d_model

    def forward(self, ids):
        t = ids.shape[1]
        position = torch.arange(t, dtype=torch.float32, device=ids.device)[:, None]
        div = torch.exp(torch.arange(0, self.d_model, 2, dtype=torch.float32, device=ids.device) * (-math.log(10000.0) / self.d_model))
        pe = torch.zeros(t, self.d_model, device=ids.device)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        x = self.tokens(ids) + pe
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=ids.device, dtype=torch.bool)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def reverse_batch(rng, batch, device, symbols=10, lengths=(8, 16)):
    """A batch of reversals as the trainer lays it out: `input SEP output EOS`, targets the
    next token on the output positions (PAD elsewhere), right padded; and its real tokens."""
    rows, targets = [], []
    for _ in range(batch):
        n = rng.randint(lengths[0], lengths[1])
        inp = [FIRST + rng.randrange(symbols) for _ in range(n)]
        out = inp[::-1] + [EOS]
        seq = inp + [SEP] + out
        tgt = [PAD] * len(seq)
        tgt[n:n + len(out)] = out
        rows.append(seq)
        targets.append(tgt)
    width = max(map(len, rows))
    pad = lambda r: r + [PAD] * (width - len(r))
    ids = torch.tensor([pad(r) for r in rows], device=device)
    tgt = torch.tensor([pad(r) for r in targets], device=device)
    return ids, tgt, sum(map(len, rows))


def train_step(model, optim, loss_fn, ids, tgt):
    """One step of the trainer's: forward, cross-entropy over the output tokens, backward,
    clipping of the gradient norm at 1, AdamW; returns the loss."""
    logits = model(ids)
    loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    return loss


def bench_trainer(size, device, steps):
    """Mean milliseconds and tokens per second of `steps` training steps after the same
    steps' batches once untimed."""
    import random

    d_model, layers, heads, lr = TRAINER_SIZES[size]
    torch.manual_seed(0)
    rng = random.Random(0)
    vocab = FIRST + 10
    model = Decoder(vocab, d_model, layers, heads).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(rng):
        ids, tgt, tokens = reverse_batch(rng, 64, device)
        train_step(model, optim, loss_fn, ids, tgt)
        return tokens

    # The timed batches once untimed first, as the Rust benchmark does (a new batch length
    # is a new shape there).
    for _ in range(steps):
        step(rng)
    sync()
    rng = random.Random(0)
    start = time.perf_counter()
    tokens = sum(step(rng) for _ in range(steps))
    sync()
    seconds = time.perf_counter() - start
    return dict(subject=f"pytorch-trainer-{size}", pass_="train-step", median_ms=seconds * 1e3 / steps, runs=steps,
                tokens_per_second=tokens / seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="small,base,long", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="also write every measurement to this file")
    parser.add_argument("--trainer", action="store_true", help="time whole training steps instead (see above)")
    parser.add_argument("--train-steps", type=int, default=20, help="training steps timed per size")
    parser.add_argument("--dtype", default="f32", help="comma-separated float dtypes: f32, f16, bf16")
    parser.add_argument("--long-core", type=int, help="also time the causal core alone at this many positions, with peak memory")
    parser.add_argument("--queued", action="store_true", help="also time each call queued (see above)")
    args = parser.parse_args()
    for flag in ("runs", "train_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    global QUEUE
    QUEUE = args.queued

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {args.threads} threads"

    def write_json(records):
        """The records so far, written through a temporary name: a step killed later (a
        time limit, a crash) leaves every measurement made before it."""
        if args.json:
            tmp = f"{args.json}.tmp"
            with open(tmp, "w") as f:
                json.dump(dict(torch=torch.__version__, device=args.device, device_name=where, threads=args.threads, records=records), f, indent=1)
            os.replace(tmp, args.json)

    if args.trainer:
        print(f"## PyTorch {torch.__version__} on {args.device} ({where}): whole training steps, batch 64\n")
        print("| size | ms per step | tokens/s |")
        print("|---|---|---|")
        records = []
        for size in TRAINER_SIZES:
            r = bench_trainer(size, device, args.train_steps)
            records.append(r)
            print(f"| {size} | {r['median_ms']:.1f} | {r['tokens_per_second']:.0f} |", flush=True)
            write_json(records)
        write_json(records)
        return
    shapes = [s for s in args.shapes.split(",") if s != "none"]
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: unknown shape {s!r} ({', '.join(SHAPES)}, none)")
    dtypes = args.dtype.split(",")
    for dt in dtypes:
        if dt not in DTYPES:
            parser.error(f"--dtype: unknown dtype {dt!r} ({', '.join(DTYPES)})")
    records = []
    for dt in dtypes:
        if not shapes:
            break
        print(f"## PyTorch {torch.__version__} on {args.device} ({where}), {dt}: causal self-attention, median ms (GFLOP/s)\n")
        print("| shape (B, T, D, H) | fwd | fwd+bwd | core fwd | core fwd+bwd |")
        print("|---|---|---|---|---|")
        for s in shapes:
            try:
                rs = bench(s, device, args.runs, dt)
            except Exception as err:  # a dtype the device lacks, out of memory: the next
                print(f"| {s} | failed: {type(err).__name__}: {err} | | | |", flush=True)
                continue
            records.extend(rs)
            write_json(records)
            cell = {(r["subject"], r["pass_"]): f"{r['median_ms']:.1f} ({r['gflops']:.0f})" for r in rs}
            if args.queued:
                for r in rs:
                    queued = f"{r['queued_ms']:.2f} queued ({r['queued_calls']})" if "queued_ms" in r else "not queued"
                    cell[r["subject"], r["pass_"]] += f", {queued}"
            b, t, d, h = SHAPES[s]
            print(
                f"| {s} ({b}, {t}, {d}, {h}) | {cell['pytorch', 'forward']} | {cell['pytorch', 'forward+backward']} "
                f"| {cell['pytorch-core', 'forward']} | {cell['pytorch-core', 'forward+backward']} |",
                flush=True,
            )
        print()
    if args.long_core:
        print(f"## PyTorch {torch.__version__} on {args.device} ({where}): causal core alone, batch 1, 8 heads of 64, forward+backward\n")
        print("| positions | dtype | median ms | GFLOP/s | peak memory (MiB) |")
        print("|---|---|---|---|---|")
        for dt in dtypes:
            try:
                r = bench_long_core(args.long_core, device, args.runs, dt)
            except Exception as err:
                print(f"| {args.long_core} | {dt} | failed: {type(err).__name__}: {err} | | |", flush=True)
                continue
            records.append(r)
            write_json(records)
            peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            queued = f", {r['queued_ms']:.1f} queued ({r['queued_calls']})" if "queued_ms" in r else ""
            print(f"| {args.long_core} | {dt} | {r['median_ms']:.1f}{queued} | {r['gflops']:.0f} | {peak} |", flush=True)
    write_json(records)


if __name__ == "__main__":
    main()
