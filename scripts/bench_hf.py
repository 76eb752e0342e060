#!/usr/bin/env python3
"""Times transformers' `LlamaForCausalLM` and mha's (`cargo run --release -p bench --
--llama`) at one configuration, on the CPU, in one run, and prints both with their ratio.

The model is the 2-layer Llama of the fixtures scaled up (`LLAMA` in
`examples/bench/src/llama.rs`, repeated here): width 512, 8 query heads and 2 key/value
heads of 64, feed-forward 768, a vocabulary of 50, f32, random weights. Two numbers each:
the forward of 512 tokens (batch 1, no gradient), and one decoding step after 512 cached
positions (transformers' `DynamicCache`, its new token cropped after each step; mha's cache,
whose context grows by one per timed step). Each is the median of --runs runs after a
warm-up. transformers runs its default attention (`sdpa`) on --threads threads; the Rust
binary runs on flex with one thread per core, which --threads should match.

    cargo build --release -p bench
    python3 scripts/bench_hf.py --threads 2
    python3 scripts/bench_hf.py --threads 2 --json hf.json

Needs `torch` and `transformers` (`python3 -m pip install torch transformers`).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOKENS = 512


def median_ms(runs, f):
    f()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_transformers(runs):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=500.0,
        vocab_size=50, tie_word_embeddings=False, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, TOKENS))
    with torch.inference_mode():
        forward = median_ms(runs, lambda: model(input_ids=ids))
        cache = DynamicCache(config=config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        token = ids[:, :1]
        position = torch.tensor([[TOKENS]])

        def step():
            model(input_ids=token, past_key_values=cache, use_cache=True, position_ids=position)
            cache.crop(-1)

        decode = median_ms(runs, step)
    return {"forward": forward, "decode-step": decode, "attention": config._attn_implementation}


def time_mha(binary, runs, threads):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mha.json")
        cmd = [binary, "--backend", "flex", "--shapes", "none", "--no-train", "--llama",
               "--runs", str(runs), "--json", out]
        # As many threads as PyTorch's: the CPU kernels' pool is rayon's.
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        with open(out) as f:
            records = json.load(f)
    return {r["pass"]: r["median_ms"] for r in records if r["subject"] == "llama"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=9)
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    parser.add_argument("--binary", default=os.path.join(target, "release", "bench"),
                        help="the release build of examples/bench (in CARGO_TARGET_DIR where set)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    if not os.path.exists(args.binary):
        sys.exit(f"{args.binary}: build it first (cargo build --release -p bench)")
    torch.set_num_threads(args.threads)
    hf = time_transformers(args.runs)
    ours = time_mha(args.binary, args.runs, args.threads)
    print(f"Llama, 2 layers, width 512, 8/2 heads of 64, f32, CPU, {args.threads} threads "
          f"(torch {torch.__version__}, attention {hf['attention']}), medians of {args.runs}:")
    print(f"{'':32} {'transformers':>12} {'mha (flex)':>12} {'mha / transformers':>19}")
    rows = [("forward, 512 tokens", "forward"), ("one decoding step after 512", "decode-step")]
    for label, key in rows:
        print(f"{label:32} {hf[key]:10.2f} ms {ours[key]:10.2f} ms {ours[key] / hf[key]:18.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "runs": args.runs, "transformers": hf,
                       "mha": ours}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
