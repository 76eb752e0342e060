#!/usr/bin/env bash
# One command for a machine with a GPU: times mha's MultiHeadAttention, Burn's built-in
# module and the attention core on every GPU backend this machine builds (wgpu always;
# cuda where `nvidia-smi` finds a GPU; wgpu again through Burn's SPIR-V compiler, the
# `vulkan` feature, where NVIDIA's Vulkan driver is), in f32, f16 and bf16 (a backend that does not
# compute in a dtype is named and skipped), at the small, base and long shapes, plus the
# causal core alone at 16384 positions forward+backward with its peak GPU memory (each
# backend and dtype in a process of its own, so that the peak is the core's); then
# PyTorch's attention on CUDA at the same shapes (scripts/bench_pytorch.py --device cuda)
# where a CUDA PyTorch is installed. Writes OUT/gpu_bench.json (every measurement) and
# OUT/gpu_bench.md (every table).
#
#   scripts/gpu_bench.sh [OUT]            # release build, 7 runs per measurement
#   scripts/gpu_bench.sh --smoke [OUT]    # tiny shape, one run, debug build (CI, lavapipe)
#
# On a GPU machine without a Rust toolchain, binaries built elsewhere stand in for the
# builds: MHA_BENCH_BIN (built with `--release -p bench --features wgpu,cuda`) and, for the
# SPIR-V timings, MHA_BENCH_VULKAN_BIN (`--features vulkan,cuda`); with MHA_BENCH_BIN alone
# the SPIR-V build is not timed. MHA_GPU_BENCH_BACKENDS="wgpu cuda" names the backends
# instead of those found; MHA_GPU_BENCH_PYTORCH=0 leaves PyTorch out.
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
# MHA_GPU_BENCH_BACKENDS="wgpu cuda": the backends to time, instead of those found.
if [ -n "${MHA_GPU_BENCH_BACKENDS:-}" ]; then
    backends=()
    for b in $MHA_GPU_BENCH_BACKENDS; do backends+=(--backend "$b"); done
fi
if [ "$smoke" -eq 1 ]; then
    # The features CI's test suite builds, so that the smoke run adds no build of Burn.
    features=ndarray,wgpu
    profile=()
    # The long core in the main run: its memory is not read in a smoke run.
    args=(--shapes tiny --runs 1 --long-core 256)
    long=0
else
    profile=(--release)
    args=(--shapes small,base,long --runs 7)
    long=16384
fi
dtypes=f32,f16,bf16

# `bench FEATURES ARGS...`: the benchmark built with FEATURES, or the prebuilt binary.
bench() {
    local features="$1"
    shift
    local bin="${MHA_BENCH_BIN:-}"
    if [ "$features" = vulkan ]; then bin="${MHA_BENCH_VULKAN_BIN:-}"; fi
    if [ -n "$bin" ]; then
        "$bin" "$@"
    else
        cargo run "${profile[@]}" -q -p bench --features "$features" -- "$@"
    fi
}

echo "== mha and Burn on ${backends[*]} (features $features)" >&2
bench "$features" \
    "${backends[@]}" "${args[@]}" --dtype "$dtypes" --no-train --json "$out/mha.json" \
    | tee "$out/mha.md"

# The long causal core, each backend and dtype in a process of its own: the peak memory
# is the memory pool's since the process started, so that nothing timed before it counts.
if [ "$long" -gt 0 ]; then
    : > "$out/long.rows"
    for ((i = 1; i < ${#backends[@]}; i += 2)); do
        b=${backends[$i]}
        for d in ${dtypes//,/ }; do
            echo "== the causal core at $long positions on $b in $d" >&2
            bench "$features" --backend "$b" --shapes none --no-train --no-builtin --runs 3 \
                --dtype "$d" --long-core "$long" --json "$out/long-$b-$d.json" \
                | grep '^| [0-9]' | sed "s/^| /| $b | /" >> "$out/long.rows" || true
        done
    done
    {
        echo "## causal attention core alone, batch 1, 8 heads of 64, forward+backward, each in a process of its own"
        echo
        echo "| backend | positions | dtype | median ms | GFLOP/s | peak memory (MiB) |"
        echo "|---|---|---|---|---|---|"
        cat "$out/long.rows"
    } | tee "$out/long.md"
else
    echo "(the long core in the run above)" > "$out/long.md"
fi

# Burn's `vulkan` feature: the same wgpu device, every kernel compiled to SPIR-V instead of
# WGSL. Only on a Vulkan GPU: Mesa's lavapipe 22.3 crashes creating SPIR-V pipelines.
vulkan=0
# Where NVIDIA's Vulkan driver is installed, or MHA_GPU_BENCH_VULKAN=1 asks for it (Mesa
# installs its Intel and AMD drivers whether or not such a GPU is there).
nvidia_icd=$(ls ${VK_DRIVER_FILES:-} /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd*.json 2>/dev/null | head -1 || true)
if [ -n "${MHA_BENCH_BIN:-}" ] && [ -z "${MHA_BENCH_VULKAN_BIN:-}" ]; then
    echo "== MHA_BENCH_BIN without MHA_BENCH_VULKAN_BIN: the SPIR-V build not timed" >&2
elif [ "$smoke" -eq 0 ] && { [ -n "$nvidia_icd" ] || [ "${MHA_GPU_BENCH_VULKAN:-0}" = 1 ]; }; then
    echo "== mha and Burn on wgpu through SPIR-V (features vulkan)" >&2
    { echo "# wgpu through SPIR-V (\`--features vulkan\`)"; echo; } > "$out/vulkan.md"
    if bench vulkan \
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
# MHA_GPU_BENCH_PYTORCH=0: PyTorch not timed (timed by its own command instead).
if [ "${MHA_GPU_BENCH_PYTORCH:-1}" = 0 ]; then
    echo "== PyTorch not timed (MHA_GPU_BENCH_PYTORCH=0)" >&2
    echo "PyTorch not timed in this run." > "$out/pytorch.md"
elif [ "$smoke" -eq 0 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
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
import glob
merged = {"mha": json.load(open(f"{out}/mha.json"))}
for path in sorted(glob.glob(f"{out}/long-*.json")):
    merged["mha"] += json.load(open(path))
parts = ["mha.md", "long.md"] + (["vulkan.md"] if vulkan else []) + ["pytorch.md"]
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
