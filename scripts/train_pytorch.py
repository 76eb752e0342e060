#!/usr/bin/env python3
"""Trains the trainer's reverse task in PyTorch until it reaches a held-out exact accuracy,
for comparing wall time with `cargo run --release -p train` on the same machine.

The model, batches and optimiser are those of `scripts/bench_pytorch.py --trainer` (the
trainer's decoder-only model: token embedding plus sinusoids, pre-norm causal
`nn.TransformerEncoderLayer`s with GELU and no dropout, a final LayerNorm, a linear head;
cross-entropy over the output tokens, clipping of the gradient norm at 1, AdamW with
weight decay 0.01 at a constant learning rate), at the reference size by default (d_model
128, 3 layers, 4 heads, feed-forward 512, learning rate 1e-3, batch 64, reversals of 8 to
16 of 10 symbols). Every --eval-every steps it decodes --eval-examples held-out inputs
greedily (a batch per input length, the whole prefix recomputed at each token) and stops
at the first evaluation whose exact accuracy reaches --target. The wall time counts the
training steps and the evaluations, as the trainer's does.

    python3 scripts/train_pytorch.py --threads 2                  # reference size, to 99%
    python3 scripts/train_pytorch.py --threads 2 --size default   # the trainer's default model

It prints one line per evaluation and a summary; --json writes the summary.
"""

import argparse
import json
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pytorch import EOS, FIRST, PAD, SEP, TRAINER_SIZES, Decoder, reverse_batch, train_step  # noqa: E402

SYMBOLS, LENGTHS = 10, (8, 16)


def held_out(count, seed):
    """`count` inputs of 8 to 16 symbols, none of them in the training stream's seed."""
    rng = random.Random(seed)
    return [[FIRST + rng.randrange(SYMBOLS) for _ in range(rng.randint(*LENGTHS))] for _ in range(count)]


@torch.no_grad()
def exact_accuracy(model, inputs, device):
    """The share of inputs whose greedy decoding is their reversal followed by EOS."""
    model.eval()
    by_length = {}
    for inp in inputs:
        by_length.setdefault(len(inp), []).append(inp)
    right = 0
    for n, group in by_length.items():
        ids = torch.tensor([inp + [SEP] for inp in group], device=device)
        for _ in range(n + 1):
            next_token = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_token], dim=1)
        want = torch.tensor([inp[::-1] + [EOS] for inp in group], device=device)
        right += (ids[:, n + 1:] == want).all(dim=1).sum().item()
    model.train()
    return right / len(inputs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="reference", choices=sorted(TRAINER_SIZES))
    parser.add_argument("--target", type=float, default=0.99, help="held-out exact accuracy to reach")
    parser.add_argument("--eval-every", type=int, default=100, help="training steps between evaluations")
    parser.add_argument("--eval-examples", type=int, default=1000)
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")

    d_model, layers, heads, lr = TRAINER_SIZES[args.size]
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    vocab = FIRST + SYMBOLS
    model = Decoder(vocab, d_model, layers, heads).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD)
    evaluation = held_out(args.eval_examples, args.seed + 1_000_003)
    print(f"PyTorch {torch.__version__} on {platform.machine()}, {torch.get_num_threads()} threads: "
          f"{args.size} size (d_model {d_model}, {layers} layers, {heads} heads), to {args.target:.2%}")

    start = time.perf_counter()
    tokens, step, accuracy, loss = 0, 0, 0.0, float("nan")
    while step < args.max_steps:
        ids, tgt, real = reverse_batch(rng, args.batch_size, device, SYMBOLS, LENGTHS)
        loss = train_step(model, optim, loss_fn, ids, tgt)
        tokens += real
        step += 1
        if step % args.eval_every == 0:
            accuracy = exact_accuracy(model, evaluation, device)
            elapsed = time.perf_counter() - start
            print(f"step {step}: loss {loss.item():.4f}, held-out exact {accuracy:.2%}, {elapsed:.1f} s")
            if accuracy >= args.target:
                break
    seconds = time.perf_counter() - start
    summary = dict(size=args.size, steps=step, exact_accuracy=accuracy, reached=accuracy >= args.target,
                   target=args.target, wall_seconds=seconds, tokens_per_second=tokens / seconds,
                   final_loss=loss.item(), threads=torch.get_num_threads(), torch=torch.__version__)
    print(f"{'reached' if summary['reached'] else 'did not reach'} {args.target:.2%} after {step} steps: "
          f"{seconds:.1f} s wall, {summary['tokens_per_second']:.0f} tokens/s (evaluations included)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
