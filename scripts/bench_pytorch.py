#!/usr/bin/env python3
"""Times PyTorch at the shapes of `cargo run --release -p bench`, for side-by-side tables.

Causal self-attention with `torch.nn.MultiheadAttention` (batch_first, dropout 0, no
weights returned, `is_causal=True` with its mask), forward (under `torch.inference_mode`)
and forward+backward (`out.sum().backward()`, the input requiring grad), and the core
`torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`. Each number
is the median of --runs runs after one warm-up run; CUDA is synchronised after each run.
GFLOP/s count the same work as the Rust benchmark: `8·B·T·D²` for the projections and
`2·B·T²·D` for the causal attention products, forward; a backward counts twice the forward.

    python3 scripts/bench_pytorch.py                    # CPU, every thread
    python3 scripts/bench_pytorch.py --threads 2 --json pytorch.json
    python3 scripts/bench_pytorch.py --device cuda
"""

import argparse
import json
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


def timed(runs, device, f):
    """Median milliseconds of f over `runs` runs after a warm-up (at most 3 if it is slow)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    f()
    sync()
    if time.perf_counter() - start > 2.0:
        runs = min(runs, 3)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), runs


def bench(shape_name, device, runs):
    b, t, d, h = SHAPES[shape_name]
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(d, h, dropout=0.0, batch_first=True).to(device)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=device, dtype=torch.bool)
    x = torch.randn(b, t, d, device=device)
    records = []

    def record(subject, pass_, result, flops):
        ms, n = result
        records.append(
            dict(shape=shape_name, subject=subject, pass_=pass_, median_ms=ms, runs=n,
                 gflops=flops / ms / 1e6)
        )

    def forward():
        with torch.inference_mode():
            mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)

    xg = x.clone().requires_grad_()

    def forward_backward():
        out, _ = mha(xg, xg, xg, attn_mask=mask, is_causal=True, need_weights=False)
        out.sum().backward()

    fwd = mha_flops(b, t, d)
    record("pytorch", "forward", timed(runs, device, forward), fwd)
    record("pytorch", "forward+backward", timed(runs, device, forward_backward), 3 * fwd)

    q, k, v = (torch.randn(b, h, t, d // h, device=device) for _ in range(3))

    def core_forward():
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    qg, kg, vg = (a.clone().requires_grad_() for a in (q, k, v))

    def core_forward_backward():
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()

    core = core_flops(b, t, d)
    record("pytorch-core", "forward", timed(runs, device, core_forward), core)
    record("pytorch-core", "forward+backward", timed(runs, device, core_forward_backward), 3 * core)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="small,base,long", help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: unknown shape {s!r} ({', '.join(SHAPES)})")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {args.threads} threads"
    print(f"## PyTorch {torch.__version__} on {args.device} ({where}): causal self-attention, median ms (GFLOP/s)\n")
    print("| shape (B, T, D, H) | fwd | fwd+bwd | core fwd | core fwd+bwd |")
    print("|---|---|---|---|---|")
    records = []
    for s in shapes:
        rs = bench(s, device, args.runs)
        records.extend(rs)
        cell = {(r["subject"], r["pass_"]): f"{r['median_ms']:.1f} ({r['gflops']:.0f})" for r in rs}
        b, t, d, h = SHAPES[s]
        print(
            f"| {s} ({b}, {t}, {d}, {h}) | {cell['pytorch', 'forward']} | {cell['pytorch', 'forward+backward']} "
            f"| {cell['pytorch-core', 'forward']} | {cell['pytorch-core', 'forward+backward']} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, device=args.device, threads=args.threads, records=records), f, indent=1)


if __name__ == "__main__":
    main()
