#!/usr/bin/env bash
# One command for a machine with a GPU: times mha's MultiHeadAttention, Burn's built-in
# module and the attention core on every GPU backend this machine builds (wgpu always;
# cuda where `nvidia-smi` finds a GPU; wgpu again through Burn's SPIR-V compiler, the
# `vulkan` feature, where NVIDIA's Vulkan driver is), in f32, f16 and bf16 (a backend that does not
# compute in a dtype is named and skipped), at the small, base and long shapes, plus the
# causal core alone at 16384 positions forward+backward with its peak GPU memory; then
# PyTorch's attention on CUDA at the same shapes (scripts/bench_pytorch.py --device cuda)
# where a CUDA PyTorch is installed. Writes OUT/gpu_bench.json (every measurement) and
# OUT/gpu_bench.md (every table).
#
#   scripts/gpu_bench.sh [OUT]            # release build, 7 runs per measurement
#   scripts/gpu_bench.sh --smoke [OUT]    # tiny shape, one run, debug build (CI, lavapipe)
set -euo pipefail
cd "$(dirname "$0")/.."

smoke=0
if [ "${1:-}" = "--smoke" ]; then
    smoke=1
    shift
fi
out="${1:-gpu-bench}"
mkdir -p "$out"

features=wgpu
backends=(--backend wgpu)
if [ "$smoke" -eq 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    features=wgpu,cuda
    backends=(--backend wgpu --backend cuda)
fi
if [ "$smoke" -eq 1 ]; then
    # The features CI's test suite builds, so that the smoke run adds no build of Burn.
    features=ndarray,wgpu
    profile=()
    args=(--shapes tiny --runs 1 --long-core 256)
else
    profile=(--release)
    args=(--shapes small,base,long --runs 7 --long-core 16384)
fi
dtypes=f32,f16,bf16

echo "== mha and Burn on ${backends[*]} (features $features)" >&2
cargo run "${profile[@]}" -q -p bench --features "$features" -- \
    "${backends[@]}" "${args[@]}" --dtype "$dtypes" --no-train --json "$out/mha.json" \
    | tee "$out/mha.md"

# Burn's `vulkan` feature: the same wgpu device, every kernel compiled to SPIR-V instead of
# WGSL. Only on a Vulkan GPU: Mesa's lavapipe 22.3 crashes creating SPIR-V pipelines.
vulkan=0
# Where NVIDIA's Vulkan driver is installed, or MHA_GPU_BENCH_VULKAN=1 asks for it (Mesa
# installs its Intel and AMD drivers whether or not such a GPU is there).
nvidia_icd=$(ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json 2>/dev/null | head -1 || true)
if [ "$smoke" -eq 0 ] && { [ -n "$nvidia_icd" ] || [ "${MHA_GPU_BENCH_VULKAN:-0}" = 1 ]; }; then
    echo "== mha and Burn on wgpu through SPIR-V (features vulkan)" >&2
    { echo "# wgpu through SPIR-V (\`--features vulkan\`)"; echo; } > "$out/vulkan.md"
    if cargo run "${profile[@]}" -q -p bench --features vulkan -- \
        --backend wgpu "${args[@]}" --dtype "$dtypes" --no-train --json "$out/vulkan.json" \
        | tee -a "$out/vulkan.md"; then
        vulkan=1
    else
        echo "warning: the SPIR-V build failed; its numbers are left out" >&2
    fi
elif [ "$smoke" -eq 1 ]; then
    echo "== smoke run: the SPIR-V build not timed" >&2
else
    echo "== no NVIDIA Vulkan driver (MHA_GPU_BENCH_VULKAN=1 to force): the SPIR-V build not timed" >&2
fi

pytorch=0
if [ "$smoke" -eq 0 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "== PyTorch on CUDA" >&2
    python3 scripts/bench_pytorch.py --device cuda --shapes small,base,long --runs 7 \
        --dtype "$dtypes" --long-core 16384 --json "$out/pytorch.json" | tee "$out/pytorch.md"
    pytorch=1
else
    echo "== no CUDA PyTorch here: PyTorch not timed" >&2
    echo "No CUDA PyTorch on this machine: PyTorch not timed." > "$out/pytorch.md"
fi

# One JSON and one markdown file.
python3 - "$out" "$pytorch" "$vulkan" <<'PY'
import json, sys
out, pytorch, vulkan = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
merged = {"mha": json.load(open(f"{out}/mha.json"))}
parts = ["mha.md"] + (["vulkan.md"] if vulkan else []) + ["pytorch.md"]
if vulkan:
    merged["mha_spirv"] = json.load(open(f"{out}/vulkan.json"))
if pytorch:
    merged["pytorch"] = json.load(open(f"{out}/pytorch.json"))
json.dump(merged, open(f"{out}/gpu_bench.json", "w"), indent=1)
with open(f"{out}/gpu_bench.md", "w") as md:
    for part in parts:
        md.write(open(f"{out}/{part}").read().strip() + "\n\n")
PY
echo "== wrote $out/gpu_bench.json and $out/gpu_bench.md" >&2
