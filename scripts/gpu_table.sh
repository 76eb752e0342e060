#!/usr/bin/env bash
# The GPU table: mha's MultiHeadAttention, Burn's built-in module and the attention core
# on wgpu (through WGSL, and through Burn's SPIR-V compiler, the `vulkan` build), beside
# PyTorch's attention on CUDA, at the base and long shapes in f32 and f16, plus the
# causal core alone at 16384 positions with its peak memory. Made for a machine with an
# NVIDIA GPU, PyTorch with CUDA, no network and no Rust toolchain: the binaries are built
# and packed elsewhere. docs/gpu.md says the same at more length.
#
# 1. On a machine that builds this repository (a Rust toolchain, Debian's apt):
#        scripts/gpu_table.sh --pack [PACK]
#    builds the benchmark in release twice (`--features wgpu`, `--features vulkan`; the
#    cuda backend cannot be built without network: its build downloads an LLVM) and mha's
#    unit tests in the vulkan build (debug), strips and compresses the three, downloads Debian's Vulkan loader and the GL dispatch libraries
#    NVIDIA's driver links to (libvulkan1, libglvnd0, ...) for a machine that lacks them,
#    and checks that PACK (default gpu-pack/) holds under 64 MiB.
# 2. On the GPU machine, from the repository's root with PACK beside scripts/, OUT a new
#    or empty folder:
#        scripts/gpu_table.sh --run PACK OUT
#    unpacks the binaries (and the libraries where `ldconfig` lacks them), then runs PyTorch
#    on CUDA first (the tiny shape too), then the cooperative-matrix kernels' test, then
#    each build and dtype in a process of its own under its own time limit, so that a
#    crash or a timeout loses one step: WGSL f16 (with `--variants`, mha's core between
#    projections made otherwise than the module's), SPIR-V f16 and its causal core at
#    16,384 positions with its peak memory, WGSL f32 (`--variants` too), the other long
#    cores (one process a build, tile product and dtype: WGSL f16 and f32, SPIR-V f16 on
#    the portable product), WGSL's decoding step (`--decode`, and the core alone in it,
#    `--decode-core`) on the decoding kernels and
#    on the tiled forward (MHA_GPU_DECODE=tiles), WGSL's floor (`--floor`: what a call costs where there is
#    next to nothing to compute, and the tiny shape), WGSL's costs around the kernels
#    (`--overhead`, kernel by kernel), SPIR-V f16 on the portable tile product and its
#    costs around the kernels and floor, SPIR-V f32. The table's steps time each call
#    synced, and queued too where it takes 2 s or less (`--queued`), PyTorch's the same;
#    after every step it rewrites
#    OUT/gpu_table.md (scripts/gpu_table.py) and OUT/gpu_table.tar.gz (every result and
#    log). The whole run stays within 9 minutes (MHA_GPU_TABLE_BUDGET seconds): a step
#    whose limit would pass it is given what is left (and, stopped there, says so, not
#    counted as failed), one with under 20 s left is skipped and says so. Autotuning is
#    bounded (CUBECL_AUTOTUNE_LEVEL=minimal).
#        scripts/gpu_table.sh --tiles PACK OUT
#    instead times the causal core at 4096 positions with each of the kernels' tiles that
#    fit first in their order of preference (MHA_GPU_TILES), kernel by kernel: SPIR-V in
#    f16 (cooperative matrices), WGSL in f32 and f16; the same budget. Then
#        MHA_GPU_TABLE_TILES=OUT scripts/gpu_table.sh --run PACK OUT2
#    runs the table with each kernel on the tiles it ran fastest with there, in each build
#    and dtype (`gpu_table.py --best-tiles`; OUT2/tiles.tsv says which, and what each beat).
#        scripts/gpu_table.sh --trainer PACK OUT
#    instead times the trainer: PyTorch's training steps on CUDA (`bench_pytorch.py
#    --trainer`), the trainer's steps on wgpu (WGSL) at its default and reference sizes,
#    a whole default run (`bench train --backend wgpu`: reverse, 1000 steps, to its
#    held-out accuracy) through WGSL and through SPIR-V, each into OUT/train-BUILD/
#    (summary.json), then the trainer's steps on this machine's CPU (flex); the same
#    budget.
# 3. In CI, on Mesa's lavapipe:
#        scripts/gpu_table.sh --dry-run OUT
#    packs the debug build CI made (`cargo build --features ndarray,wgpu --bins`, and the
#    unit tests of `cargo test --features ndarray,wgpu --lib`), then
#    runs step 2 on it at a tiny shape with one run, its steps on the tiles chosen from two
#    steps of `--tiles` at 256 positions run first (as MHA_GPU_TABLE_TILES chooses), then
#    `--trainer`'s steps, 2 of each, with a whole run of a tiny model:
#    the script is known to work before it meets a GPU. It fails if a step that could
#    run failed (a benchmark with a measurement that failed exits with an error).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
xz_level=9
# What NVIDIA's Vulkan driver needs beside itself: the loader, and the GL dispatch
# libraries its ICD (libGLX_nvidia) links to. Without the second, the loader finds the
# ICD and no adapter ("no adapter found on the requested graphics API"; H200, 2026-11-27).
loader_debs="libvulkan1 libglvnd0 libglx0 libegl1 libgl1 libgles2 libopengl0"

# `pack_dir_free PACK`: ends the script unless PACK is new, empty or an earlier pack
# (its `commit` beside nothing but a pack's files), which `pack` replaces: it removes
# nothing else.
pack_dir_free() {
    local dir="$1"
    local listing
    [ -d "$dir" ] && listing=$(ls -A "$dir") && [ -n "$listing" ] || return 0
    if [ ! -f "$dir/commit" ] ||
        grep -vxE 'commit|bench-(wgsl|spirv)(\.xz)?|mha-tests(\.xz)?|debs' <<< "$listing" > /dev/null; then
        echo "error: $dir holds files that are not an earlier pack's; name a new or empty folder" >&2
        exit 2
    fi
}

# `pack PACK WGPU_BIN [VULKAN_BIN] [TESTS_BIN]`: the binaries stripped and compressed
# into PACK (an empty VULKAN_BIN: none), in place of an earlier pack there.
pack() {
    local dir="$1" wgpu="$2" vulkan="${3:-}" tests="${4:-}"
    pack_dir_free "$dir"
    rm -rf "$dir"
    mkdir -p "$dir"
    strip -o "$dir/bench-wgsl" "$wgpu"
    if [ -n "$vulkan" ]; then strip -o "$dir/bench-spirv" "$vulkan"; fi
    if [ -n "$tests" ]; then strip -o "$dir/mha-tests" "$tests"; fi
    xz -T0 "-$xz_level" "$dir"/bench-* $([ -z "$tests" ] || echo "$dir/mha-tests")
    # The commit the binaries were built from, marked `-dirty` where tracked files differ
    # from it (the binaries hold the changes, which the commit does not).
    local commit
    commit=$(git rev-parse HEAD 2>/dev/null) || commit=unknown
    if [ "$commit" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then
        commit="$commit-dirty"
    fi
    echo "$commit" > "$dir/commit"
}

# `lib_tests FEATURES`: the path of mha's unit-test binary built with FEATURES (built at
# the workspace's level, as CI builds it, so that the dependencies' features match); a
# build that fails prints its errors and ends the script.
lib_tests() {
    local log
    log=$(mktemp)
    if ! cargo test --features "$1" --lib --no-run --message-format=json 2> "$log" > "$log.json"; then
        echo "error: mha's unit tests (features $1) did not build:" >&2
        # The compiler's errors are in the JSON messages; cargo's own words on stderr.
        python3 -c 'import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    msg = m.get("message") or {}
    if m.get("reason") == "compiler-message" and msg.get("level") == "error":
        sys.stderr.write(msg.get("rendered") or "")' < "$log.json"
        tail -n 30 "$log" >&2
        rm -f "$log" "$log.json"
        exit 1
    fi
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable") or ""
    if m.get("target", {}).get("name") == "mha" and exe:
        print(exe)' < "$log.json"
    rm -f "$log" "$log.json"
}

if [ "${1:-}" = "--pack" ]; then
    dir="${2:-gpu-pack}"
    pack_dir_free "$dir"
    echo "== release builds of the benchmark (wgpu, then vulkan): long the first time" >&2
    cargo build --release -p bench --features wgpu
    cp "$target/release/bench" "$target/release/bench-wgpu-pack"
    cargo build --release -p bench --features vulkan
    echo "== mha's unit tests in the vulkan build (the cooperative product's check)" >&2
    tests=$(lib_tests ndarray,wgpu,vulkan)
    [ -n "$tests" ] || { echo "error: no unit-test binary of mha was built" >&2; exit 1; }
    pack "$dir" "$target/release/bench-wgpu-pack" "$target/release/bench" "$tests"
    echo "== Debian's Vulkan loader and GL dispatch libraries, for a machine without them" >&2
    lists=$(mktemp -d)
    mkdir -p "$lists/partial" "$dir/debs"
    o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$lists")
    apt-get "${o[@]}" update -qq
    (cd "$dir/debs" && apt-get "${o[@]}" download $loader_debs)
    size=$(du -sb "$dir" | cut -f1)
    ls -l "$dir" "$dir/debs" >&2
    if [ "$size" -ge $((64 << 20)) ]; then
        echo "error: $dir holds $size bytes, over the pack's size limit of 64 MiB" >&2
        exit 1
    fi
    echo "== $dir: $size bytes, ready: scripts/gpu_table.sh --run $dir OUT on the GPU machine" >&2
    exit 0
fi

# OUT must be new or empty: results of an earlier run would mix into the table.
fresh_out() {
    if [ -d "$1" ] && [ -n "$(ls -A "$1")" ]; then
        echo "error: $1 is not empty (an earlier run's results?); name a new folder" >&2
        exit 2
    fi
}

# What this invocation does: `run` (the table), `tiles`, `trainer` or `dry` (the table,
# one step of the tiles and the trainer's steps, on lavapipe).
mode=
case "${1:-}" in
    --run | --tiles | --trainer)
        mode="${1#--}"
        pack_dir="${2:?$1 PACK OUT}"
        out="${3:?$1 PACK OUT}"
        fresh_out "$out"
        ;;
    --dry-run)
        mode=dry
        out="${2:?--dry-run OUT}"
        fresh_out "$out"
        pack_dir="$out/pack"
        xz_level=0
        bin="$target/debug/bench"
        # Built (or found up to date) every time: an older binary would be packed.
        cargo build -q --features ndarray,wgpu --bins
        tests=$(lib_tests ndarray,wgpu)
        mkdir -p "$out"
        pack "$pack_dir" "$bin" "" "$tests"
        ;;
    *)
        sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
        exit 2
        ;;
esac

started=$SECONDS
budget="${MHA_GPU_TABLE_BUDGET:-540}"
# A `--tiles` run's OUT whose choice of tiles the table's steps take (`tuned`): each
# kernel's fastest there, in each build and dtype it swept.
tiles_from=
# The MHA_GPU_TILES setting `tuned` chose for each build (empty: none), once each.
declare -A tiles_chosen=()
if [ "$mode" = run ] && [ -n "${MHA_GPU_TABLE_TILES:-}" ]; then
    tiles_from="$MHA_GPU_TABLE_TILES"
    if ! ls "$tiles_from"/tiles-*.log > /dev/null 2>&1; then
        echo "error: MHA_GPU_TABLE_TILES=$tiles_from holds no --tiles step's log" >&2
        exit 2
    fi
fi
mkdir -p "$out"
: > "$out/steps.tsv"
export CUBECL_AUTOTUNE_LEVEL=minimal
# NVIDIA's driver keeps the machine code it compiles from SPIR-V on disk, where it can
# write: a folder of the run's, so that the steps after the first compile less (the
# SPIR-V step's first calls took over 2 s each on an H200, 2026-11-28).
export __GL_SHADER_DISK_CACHE=1
export __GL_SHADER_DISK_CACHE_PATH="${__GL_SHADER_DISK_CACHE_PATH:-$out/.shader-cache}"
export __GL_SHADER_DISK_CACHE_SKIP_CLEANUP=1
mkdir -p "$__GL_SHADER_DISK_CACHE_PATH"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
failed=0

# Rewrites the table and the archive of everything under OUT.
archive() {
    python3 scripts/gpu_table.py "$out" > /dev/null || echo "warning: the table could not be merged" >&2
    # Written beside the results, in a folder the archive leaves out, then moved in place:
    # the archive on disk is always a whole one.
    mkdir -p "$out/.archive"
    # (Exit 1: a file changed while read, the clocks' samples that grow through the run;
    # the archive is whole.)
    local rc=0
    tar czf "$out/.archive/part" --warning=no-file-changed --exclude=./gpu_table.tar.gz \
        --exclude=./.archive --exclude=./pack --exclude="./bench-*" --exclude=./mha-tests --exclude=./vulkan-libs \
        --exclude=./.shader-cache -C "$out" . || rc=$?
    if [ "$rc" -le 1 ]; then
        mv "$out/.archive/part" "$out/gpu_table.tar.gz"
    else
        echo "warning: the archive could not be written" >&2
    fi
}

# `step NAME SECONDS CMD...`: CMD in a process of its own under a limit of SECONDS, or of
# what is left of the budget where that is less (a step stopped there is said so, not
# counted as failed), its output in OUT/NAME.log; then the table and archive. Under 20 s
# left, the step is skipped.
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((budget - (SECONDS - started))) cut=0
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left}s left of the budget" >&2
        printf '%s\tskipped: budget spent\t0\n' "$name" >> "$out/steps.tsv"
        return
    fi
    if [ "$limit" -gt "$left" ]; then
        limit=$left
        cut=1
    fi
    echo "== $name (at most ${limit}s)" >&2
    local t0=$SECONDS status rc=0
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - t0))
    # 124: the limit's SIGTERM ended it; 137: a SIGKILL, the limit's (10 s after its
    # SIGTERM) or another's (the kernel's, out of memory) before the limit.
    if [ "$rc" -eq 137 ] && [ "$took" -lt "$limit" ]; then
        rc=killed
    fi
    case $rc in
        0) status=ok ;;
        124 | 137)
            if [ "$cut" -eq 1 ]; then
                status="stopped at the end of the budget after ${limit}s"
            else
                status="timed out after ${limit}s"
                failed=1
            fi
            ;;
        killed) status="killed (SIGKILL) after ${took}s"; failed=1 ;;
        *) status="failed (exit $rc)"; failed=1 ;;
    esac
    echo "   $status" >&2
    printf '%s\t%s\t%s\n' "$name" "$status" "$took" >> "$out/steps.tsv"
    archive
}

# `skip NAME REASON`: a step that cannot run here, recorded as such.
skip() {
    echo "== $1: not run: $2" >&2
    printf '%s\tnot run: %s\t0\n' "$1" "$2" >> "$out/steps.tsv"
}

# `tuned BUILD CMD...`: CMD with MHA_GPU_TILES giving each kernel of BUILD, in each dtype,
# the tiles it ran fastest with in the sweep under $tiles_from (`--tiles`: each kernel's own
# device time; `gpu_table.py --best-tiles`), recorded once a build in OUT/tiles.tsv; CMD as
# it is where there is no sweep or it timed none of BUILD's kernels. The SPIR-V build's
# kernels on the portable product (all of them with MHA_GPU_TILE_PRODUCT=portable, and
# in f32, which cooperative matrices do not take) take WGSL's choice: the same kernels on
# the same product (the SPIR-V sweep is of the cooperative one, in f16).
tuned() {
    local build="$1" label=$1 why
    shift
    if [ -z "$tiles_from" ]; then
        "$@"
        return
    fi
    if [ "${MHA_GPU_TILE_PRODUCT:-}" = portable ]; then label="$build (portable product)"; fi
    # Chosen once a label, and recorded then.
    if [ -z "${tiles_chosen[$label]+x}" ]; then
        why=$(mktemp)
        if [ "$label" != "$build" ]; then
            tiles_chosen[$label]=$(best_tiles wgsl "" "$why")
        elif [ "$build" = spirv ]; then
            # WGSL's f32 entries, then SPIR-V's own.
            tiles_chosen[$label]=$(printf '%s;%s' "$(best_tiles wgsl f32 "$why")" \
                "$(best_tiles spirv "" "$why")" | sed 's/^;//; s/;$//')
        else
            tiles_chosen[$label]=$(best_tiles "$build" "" "$why")
        fi
        # Recorded where the sweep timed any kernel of the build, chosen or not.
        if [ -n "${tiles_chosen[$label]}" ] || grep -q . "$why"; then
            printf '%s\t%s\t%s\n' "$label" "${tiles_chosen[$label]:-(every kernel as unasked)}" \
                "$(paste -sd';' "$why" | sed 's/;/; /g')" >> "$out/tiles.tsv"
        fi
        rm -f "$why"
    fi
    if [ -z "${tiles_chosen[$label]}" ]; then
        "$@"
    else
        MHA_GPU_TILES="${tiles_chosen[$label]}" "$@"
    fi
}
# `best_tiles BUILD DTYPE WHY`: `gpu_table.py --best-tiles` of the sweep under $tiles_from
# for BUILD, its entries for DTYPE only where DTYPE is not empty; what each choice beat
# appended to the file WHY. Empty where the sweep timed none.
best_tiles() {
    local setting lines
    lines=$(mktemp)
    setting=$(python3 scripts/gpu_table.py --best-tiles "$tiles_from" "$1" 2> "$lines") || setting=
    if [ -n "$2" ]; then
        setting=$(tr ';' '\n' <<< "$setting" | { grep -F "@$2=" || true; } | paste -sd';')
        { grep -F " $2 " "$lines" || true; } >> "$3"
    else
        cat "$lines" >> "$3"
    fi
    rm -f "$lines"
    printf '%s' "$setting"
}

if [ "$mode" = dry ]; then
    shapes=tiny
    torch_shapes=tiny
    overhead_shapes=tiny
    runs=1
    long=256
    limit=900
    overhead_limit=900
    floor_limit=900
    # One dtype: the step took 148 s on lavapipe in both.
    floor_dtypes=f32
    core_limit=900
    decode_at=16
    decode_limit=900
    tiles_len=256
    tiles_limit=900
    train_steps=2
    steps_limit=900
    train_limit=900
    train_args=(--epochs 1 --steps-per-epoch 4 --eval-examples 16 --d-model 16 --layers 1
        --heads 2 --batch-size 8)
    budget="${MHA_GPU_TABLE_BUDGET:-1800}"
else
    # The shapes the README's table reports: the small one cost a third of each step.
    shapes=base,long
    # The tiny shape: what a call costs where there is next to nothing to compute.
    torch_shapes=tiny,base,long
    overhead_shapes=base,long
    runs=7
    long=16384
    # WGSL took 85 s a dtype on an H200 (2026-11-28), SPIR-V f16 over 150 s (compiling:
    # over 2 s for each first call), before the long core had steps of its own.
    limit=170
    overhead_limit=90
    floor_limit=90
    floor_dtypes=f16,f32
    # The core at 16,384 positions took 185 ms a run in f32 through WGSL.
    core_limit=45
    # Burn's cache at 2048 positions, batch 8: 1 GiB of scores a step (at 4096, 4.3 GB:
    # past a binding's 4 GiB).
    decode_at=512,2048
    # With the core alone in a step (`--decode-core`) beside the module's.
    decode_limit=90
    tiles_len=4096
    tiles_limit=60
    train_steps=40
    steps_limit=90
    # The default run: 1000 steps, then 2000 held-out sequences decoded.
    train_limit=240
    train_args=()
fi

{
    echo "commit $(cat "$pack_dir/commit" 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    # The driver's version: the Vulkan driver that runs both builds is NVIDIA's.
    nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
        --format=csv 2>/dev/null || true
} > "$out/machine.txt"
# The card's clocks and load through the run, four times a second (OUT/clocks.csv): whether
# a measurement met the device at its clocks. Stopped on exit, and by itself past the
# budget (should this script be killed before its trap runs).
sampler=
if command -v nvidia-smi > /dev/null 2>&1; then
    timeout $((budget + 30)) nvidia-smi \
        --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
        --format=csv -lms 250 > "$out/clocks.csv" 2> /dev/null &
    sampler=$!
    trap '[ -z "$sampler" ] || kill "$sampler" 2> /dev/null || true' EXIT
fi

# The Vulkan loader and the GL dispatch libraries, where the machine lacks either.
# (The list read whole first: `grep -q` stopping early would fail the pipe under pipefail.)
libs=$(ldconfig -p 2>/dev/null || true)
if ! grep -q 'libvulkan.so.1' <<< "$libs" || ! grep -q 'libGLdispatch.so.0' <<< "$libs"; then
    if ls "$pack_dir"/debs/*.deb > /dev/null 2>&1; then
        echo "== installing the packed Vulkan loader and GL dispatch libraries" >&2
        if [ "$(id -u)" = 0 ]; then
            for f in "$pack_dir"/debs/*.deb; do dpkg -x "$f" /; done
            ldconfig
        else
            # Not root: unpacked beside the results, found through LD_LIBRARY_PATH.
            libs_dir="$out/vulkan-libs"
            mkdir -p "$libs_dir"
            for f in "$pack_dir"/debs/*.deb; do dpkg -x "$f" "$libs_dir"; done
            export LD_LIBRARY_PATH="$libs_dir/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    else
        echo "warning: no Vulkan loader or GL dispatch here and none packed" >&2
    fi
fi
# NVIDIA's Vulkan driver (and its EGL vendor file) where the loader does not find it.
nvidia=/usr/local/nvidia/share
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$nvidia/vulkan/icd.d/nvidia_icd.json" ] \
    && ! ls /usr/share/vulkan/icd.d/nvidia_icd*.json /etc/vulkan/icd.d/nvidia_icd*.json > /dev/null 2>&1; then
    export VK_DRIVER_FILES="$nvidia/vulkan/icd.d/nvidia_icd.json"
fi
if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -f "$nvidia/glvnd/egl_vendor.d/10_nvidia.json" ]; then
    export __EGL_VENDOR_LIBRARY_FILENAMES="$nvidia/glvnd/egl_vendor.d/10_nvidia.json"
fi

# PyTorch on CUDA first: it needs no Vulkan and no binary of ours.
if [ "$mode" = tiles ]; then
    : # the tiles alone
elif ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
    skip "pytorch$([ "$mode" != trainer ] || echo -trainer)" "no CUDA PyTorch on this machine"
elif [ "$mode" = trainer ]; then
    step pytorch-trainer "$limit" python3 scripts/bench_pytorch.py --trainer --device cuda \
        --train-steps "$train_steps" --json "$out/pytorch-trainer.json"
else
    step pytorch "$limit" python3 scripts/bench_pytorch.py --device cuda --shapes "$torch_shapes" \
        --runs "$runs" --dtype f32,f16,bf16 --long-core "$long" --queued --json "$out/pytorch.json"
fi

# The tile product on cooperative matrices (tensor cores) against the portable one and
# f64, on every mask kind (mha's unit test, the vulkan build): where the device reports
# none, the test says so and passes.
if [ "$mode" = tiles ] || [ "$mode" = trainer ]; then
    :
elif [ -f "$pack_dir/mha-tests.xz" ]; then
    xz -dc "$pack_dir/mha-tests.xz" > "$out/mha-tests"
    chmod +x "$out/mha-tests"
    step cooperative-check 120 "$out/mha-tests" gpu::tests::gpu_cooperative --nocapture
    rm -f "$out/mha-tests"
else
    skip cooperative-check "no unit-test binary in $pack_dir"
fi

# `unpack BUILD`: the packed benchmark of BUILD as OUT/bench-BUILD; false (and a step
# recorded as not run) where the pack has none.
unpack() {
    local packed="$pack_dir/bench-$1.xz"
    if [ ! -f "$packed" ]; then
        skip "bench-$1" "no $1 build in $pack_dir"
        return 1
    fi
    xz -dc "$packed" > "$out/bench-$1" || return 1
    chmod +x "$out/bench-$1"
}

# `takes BUILD FLAG`: whether the packed benchmark of BUILD takes FLAG (a pack made
# before it did not). Its help read whole, not piped into `grep -q`, which may stop
# reading first: under pipefail the benchmark's broken pipe would say no.
takes() {
    local help
    help="$("$out/bench-$1" --help 2> /dev/null)" || return 1
    case "$help" in *"$2"*) return 0 ;; *) return 1 ;; esac
}

# `queued BUILD`: `--queued` where the packed benchmark of BUILD takes it (each call timed
# queued too, without a round trip to the device a call, as a training loop issues them;
# PyTorch the same), else nothing.
queued() {
    if takes "$1" --queued; then echo --queued; fi
}

# `timed BUILD DTYPE NAME [ARGS...]`: the modules and the core timed at every shape into
# OUT/NAME.json (rewritten after every shape: a timeout keeps the shapes done).
timed() {
    local build="$1" dtype="$2" name="$3"
    shift 3
    tuned "$build" step "$name" "$limit" "$out/bench-$build" --backend wgpu --shapes "$shapes" \
        --runs "$runs" --dtype "$dtype" --no-train $(queued "$build") --json "$out/$name.json" "$@"
}

# `long_core BUILD DTYPE NAME`: the causal core alone at $long positions, forward+backward,
# with its peak memory, in a process of its own (the memory pool's peak is the process's:
# after Burn's module at the long shape it showed 1807 MiB where the core's own was 140).
long_core() {
    local build="$1" dtype="$2" name="$3"
    tuned "$build" step "$name" "$core_limit" "$out/bench-$build" --backend wgpu --shapes none \
        --runs 3 --dtype "$dtype" --no-train --long-core "$long" $(queued "$build") \
        --json "$out/$name.json"
}

# `overhead BUILD DTYPES`: where one call of mha's module and of Burn's spends the device's
# time, kernel by kernel, with launches, buffers and the host's time to issue it
# (`--overhead`), at the base and long shapes.
overhead() {
    tuned "$1" step "overhead-$1" "$overhead_limit" "$out/bench-$1" --backend wgpu \
        --shapes "$overhead_shapes" --runs 1 --dtype "$2" --no-train --overhead
}

# `floor BUILD DTYPES`: what a call costs where there is next to nothing to compute
# (`--floor`: a sync alone, one addition, mha's core, mha's module and Burn's at the tiny
# shape, synced after each call and queued), and the tiny shape's rows of the table.
floor() {
    if ! takes "$1" --floor; then
        skip "floor-$1" "the packed $1 build predates --floor (pack again)"
        return
    fi
    tuned "$1" step "floor-$1" "$floor_limit" "$out/bench-$1" --backend wgpu --shapes tiny \
        --runs "$runs" --dtype "$2" --no-train --floor $(queued "$1") \
        --json "$out/mha-$1-floor.json"
}

# `decode BUILD`: one decoding step of the module over a cache (`--decode`, batch 1 and 8,
# at $decode_at positions), and the attention core alone in such a step (`--decode-core`:
# 1 to 16 queries, with and without GQA, where the packed build takes it), on the decoding
# kernels, then on the tiled forward (MHA_GPU_DECODE=tiles): the two ways a call of a few
# queries can run, each in a process of its own, one after the other.
decode() {
    if ! takes "$1" --decode-at; then
        skip "decode-$1" "the packed $1 build predates --decode-at (pack again)"
        return
    fi
    local core=()
    if takes "$1" --decode-core; then
        core=(--decode-core)
    fi
    tuned "$1" step "decode-$1" "$decode_limit" "$out/bench-$1" --backend wgpu --shapes none \
        --runs "$runs" --no-train --decode "${core[@]}" --decode-at "$decode_at" \
        --json "$out/decode-$1.json"
    MHA_GPU_DECODE=tiles tuned "$1" step "decode-$1_tiles" "$decode_limit" "$out/bench-$1" \
        --backend wgpu --shapes none --runs "$runs" --no-train --decode "${core[@]}" \
        --decode-at "$decode_at" --json "$out/decode-$1_tiles.json"
}

# `can_sweep BUILD`: whether the packed benchmark of BUILD can time a sweep's step (a pack
# made before `--core-kernels` cannot: recorded as a step not run).
can_sweep() {
    if takes "$1" --core-kernels; then return 0; fi
    skip "tiles-$1" "the packed $1 build predates --core-kernels (pack again)"
    return 1
}

# `sweep BUILD DTYPE TILES...`: the causal core at $tiles_len positions, forward+backward,
# with each of TILES (`units,queries,keys`, one of the kernels' candidates) first in their
# order of preference (MHA_GPU_TILES), each in a process of its own, with each kernel's
# device time.
sweep() {
    local build="$1" dtype="$2" tiles name
    shift 2
    for tiles in "$@"; do
        name="tiles-$build-$dtype-${tiles//,/-}"
        MHA_GPU_TILES="$tiles" step "$name" "$tiles_limit" "$out/bench-$build" \
            --backend wgpu --shapes none --no-train --runs 3 --dtype "$dtype" \
            --long-core "$tiles_len" --core-kernels --json "$out/$name.json"
    done
}

# `trainer`: the trainer's steps at its default and reference sizes (the benchmark's
# trainer lines: padded and packed batches, ms per step and tokens/s) on wgpu through
# WGSL, a whole default run on wgpu (`bench train`, the trainer itself) through each
# build, to its held-out accuracy, then the same steps on this machine's CPU (flex). A
# pack that predates `bench train` is refused for it.
trainer() {
    if [ "$wgsl" -eq 1 ] && ! "$out/bench-wgsl" train --help > /dev/null 2>&1; then
        skip trainer "the packed benchmark predates \`bench train\` (pack again)"
        return
    fi
    if [ "$wgsl" -eq 1 ]; then
        step trainer-steps-wgsl "$steps_limit" "$out/bench-wgsl" --backend wgpu --shapes none \
            --train-steps "$train_steps" --json "$out/trainer-wgsl.json"
        step train-wgsl "$train_limit" "$out/bench-wgsl" train --backend wgpu \
            --out "$out/train-wgsl" ${train_args[@]+"${train_args[@]}"}
    fi
    if [ "$spirv" -eq 1 ]; then
        step train-spirv "$train_limit" "$out/bench-spirv" train --backend wgpu \
            --out "$out/train-spirv" ${train_args[@]+"${train_args[@]}"}
    fi
    if [ "$wgsl" -eq 1 ]; then
        step trainer-steps-flex "$steps_limit" "$out/bench-wgsl" --backend flex --shapes none \
            --train-steps "$train_steps" --json "$out/trainer-flex.json"
    fi
}

# Each build and dtype in a process of its own, what the README's table needs first
# (after PyTorch and the cooperative check), in case the budget runs out (after a tiles
# sweep, about 330 s are left): WGSL in f16 (every
# wgpu device), with mha's core between other projections (`--variants`), SPIR-V in f16
# (Vulkan's cooperative matrices; lavapipe crashes on the invalid SPIR-V cubecl 0.11.3
# makes of shared memory on a device without an explicit workgroup layout, so the dry run
# has no such build) and its long core, then WGSL in f32 (`--variants` too). Then the
# other long cores, in a process for each build, product and dtype (its peak memory its
# own). Then WGSL's decoding step, on the decoding kernels and on the tiled forward (short
# steps; last, the budget would leave them out). Then what is needed to read the table:
# WGSL's floor of a call, its costs around the kernels, SPIR-V in f16 on the portable tile
# product (what cooperative matrices gain) and its costs around the kernels and floor.
# SPIR-V in f32 last: it outran 170 s at the base shape on an H200 (2026-11-27), where its
# f16 step took 150 s.
table() {
    if [ "$wgsl" -eq 1 ]; then
        timed wgsl f16 mha-wgsl-f16 --variants
    fi
    if [ "$spirv" -eq 1 ]; then
        timed spirv f16 mha-spirv-f16
        long_core spirv f16 mha-spirv-core-f16
    fi
    if [ "$wgsl" -eq 1 ]; then
        timed wgsl f32 mha-wgsl-f32 --variants
        long_core wgsl f16 mha-wgsl-core-f16
        long_core wgsl f32 mha-wgsl-core-f32
    fi
    if [ "$spirv" -eq 1 ]; then
        MHA_GPU_TILE_PRODUCT=portable long_core spirv f16 mha-spirv_portable-core-f16
    fi
    if [ "$wgsl" -eq 1 ]; then
        decode wgsl
        floor wgsl "$floor_dtypes"
        overhead wgsl f16,f32
    fi
    if [ "$spirv" -eq 1 ]; then
        MHA_GPU_TILE_PRODUCT=portable timed spirv f16 mha-spirv_portable-f16 --no-builtin
        overhead spirv f16
        floor spirv f16
        timed spirv f32 mha-spirv-f32
    fi
}

# `tiles`: the candidates that fit at head dim 64, each first in turn; where one does not
# fit a kernel, the kernel takes the first that fits, as without the variable (each step's
# log says which tiles each kernel took). Unasked, the portable product's 32 KiB take at
# most 64,32,32 in f32 and 128,64,32 in f16 (lavapipe, 2026-11-28); tiles asked for may
# take up to 48 KiB where the device has it (NVIDIA), as cooperative matrices do: the
# first of each list below is larger than any taken unasked, and the second is what each
# kernel takes unasked or near it. In rounds, one of each list a round (cooperative
# matrices, SPIR-V f16; then the portable product in f32 and f16): a sweep the budget
# cuts after two rounds has compared two tiles or more in every build and dtype, where one
# list after the other would leave the last unswept, or swept once (a choice without a
# comparison, which `--best-tiles` refuses).
tiles() {
    local spirv_f16=(128,64,64 128,64,32 64,32,32 32,16,32)
    local wgsl_f32=(128,64,32 64,32,32 32,16,32 32,32,16)
    local wgsl_f16=(128,64,64 128,64,32 64,32,32 32,16,32)
    local round with_spirv=0 with_wgsl=0
    if [ "$spirv" -eq 1 ] && can_sweep spirv; then with_spirv=1; fi
    if [ "$wgsl" -eq 1 ] && can_sweep wgsl; then with_wgsl=1; fi
    for round in 0 1 2 3; do
        if [ "$with_spirv" -eq 1 ]; then
            sweep spirv f16 "${spirv_f16[$round]}"
        fi
        if [ "$with_wgsl" -eq 1 ]; then
            sweep wgsl f32 "${wgsl_f32[$round]}"
            sweep wgsl f16 "${wgsl_f16[$round]}"
        fi
    done
}

wgsl=0
spirv=0
unpack wgsl && wgsl=1
unpack spirv && spirv=1
case "$mode" in
    run) table ;;
    tiles) tiles ;;
    trainer) trainer ;;
    dry)
        # The sweep's plumbing once, the table, then the trainer's steps (2 of each) and
        # a whole run of a tiny model.
        if [ "$wgsl" -eq 1 ] && can_sweep wgsl; then sweep wgsl f32 128,64,64 32,16,32; fi
        # The table's steps with the sweep's choice, as MHA_GPU_TABLE_TILES gives it.
        tiles_from="$out"
        table
        trainer
        ;;
esac
rm -f "$out"/bench-*
# The clocks' samples whole in the last archive.
[ -z "$sampler" ] || kill "$sampler" 2> /dev/null || true
sampler=

archive
cat "$out/gpu_table.md"
echo "== $out/gpu_table.md and $out/gpu_table.tar.gz, $((SECONDS - started))s" >&2
if [ "$mode" = dry ] && [ "$failed" -ne 0 ]; then
    echo "error: a step of the dry run failed (see $out/steps.tsv and its log)" >&2
    exit 1
fi
