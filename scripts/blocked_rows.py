#!/usr/bin/env python3
"""Prints what PyTorch gives for a query row whose every key is blocked: the last row of
the mask-conventions table in crates/mha/README.md.

    python3 -m pip install torch
    python3 scripts/blocked_rows.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def row(t):
    return "[" + ", ".join(f"{x:.3g}" for x in t.tolist()) + "]"


def main():
    print(f"PyTorch {torch.__version__}; row 1 blocks every key")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    attend = torch.ones(3, 3, dtype=torch.bool)
    attend[1] = False
    masks = {"bool": attend, "float -inf": torch.where(attend, 0.0, float("-inf"))}
    for name, mask in masks.items():
        for backend in [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]:
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            try:
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask)
            except RuntimeError as err:
                print(f"SDPA {name} mask, {backend.name}: not available ({err})")
                continue
            out.sum().backward()
            finite = all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))
            print(f"SDPA {name} mask, {backend.name}: output {row(out[0, 0, 1])}, "
                  f"finite gradients: {finite}")

    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 3, 8)
    for need_weights in [True, False]:
        for grad in [True, False]:
            with torch.set_grad_enabled(grad):
                out, w = mha(x, x, x, attn_mask=~attend, need_weights=need_weights)
            weights = "" if w is None else f", weights {row(w[0, 1])}"
            print(f"nn.MultiheadAttention need_weights={need_weights}, grad={grad}: "
                  f"output {row(out[0, 1, :4])}{weights}")


if __name__ == "__main__":
    main()
