#!/usr/bin/env python3
"""Merges what `scripts/gpu_table.sh` measured into one table: OUT/gpu_table.md.

Reads OUT/mha-BUILD-DTYPE.json and OUT/mha-BUILD-core-DTYPE.json (the benchmark's
records, BUILD `wgsl`, `spirv` or `spirv_portable`: SPIR-V kept off cooperative
matrices; the second the long core alone),
OUT/pytorch.json (`scripts/bench_pytorch.py --json`), OUT/floor-BUILD.log (the
benchmark's `--floor` tables), OUT/overhead-BUILD.log (its `--overhead` tables) and
OUT/decode-BUILD.log (its `--decode` tables, on the decoding kernels and, as
BUILD_tiles, on the tiled forward) and OUT/steps.tsv (each step's name, status and
seconds); writes one row per shape, pass and dtype with the median milliseconds of mha's
module, Burn's module and PyTorch's, their cores, the core between other projections
(`--variants`), and the ratios, and names each forward+backward that took less than its
forward alone (a suspect measurement); then the same table of the calls queued (where the
records have `queued_ms`: `--queued`, calls issued back to back before one sync); then
the long core, then the floor of a call (next
to nothing to compute), then what one call of each module costs around its kernels
(kernel by kernel), then a decoding step, then the core with each tile first
(OUT/tiles-BUILD-DTYPE-U-Q-K.log and .json, `--tiles`; a row for a step that wrote no
JSON too), then the tiles the table's steps asked for where they asked (OUT/tiles.tsv),
then the trainer's steps and runs (`--trainer`: OUT/trainer-BACKEND.json,
OUT/pytorch-trainer.json, OUT/train-BUILD/summary.json), then the measurements that
failed and why, then each step's status. Standard library only: it runs on the GPU
machine beside PyTorch.

    python3 scripts/gpu_table.py OUT

With `--best-tiles OUT BUILD`, instead prints the MHA_GPU_TILES setting that gives each
kernel of BUILD, in each dtype, the tiles it ran fastest with in the `--tiles` sweep under
OUT (its own device time), and on the standard error what each choice beat:

    python3 scripts/gpu_table.py --best-tiles OUT BUILD
"""

import glob
import json
import os
import re
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ms_of(r, key="median_ms"):
    """A record's median milliseconds (synced after each call; `queued_ms`: per call
    queued), "failed" where the benchmark could not time it (the call, or for
    `queued_ms` its queued batches), or None where it has no such time."""
    if r.get("failed") or r.get("median_ms") is None:
        return "failed"
    if key == "queued_ms" and r.get("queued_failed"):
        return "failed"
    return r.get(key)


def cell(value):
    return f"{value:.2f}" if isinstance(value, (int, float)) else str(value)


TRAINER_ROWS = [
    # the benchmark's subject, PyTorch's, what the row is
    ("trainer", "pytorch-trainer-default", "default size (d_model 64, 2 layers), inputs of 8 to 16, padded"),
    ("trainer-packed", None, "default size, inputs of 8 to 16, packed"),
    ("trainer-mixed", None, "default size, inputs of 1 to 16, padded"),
    ("trainer-mixed-packed", None, "default size, inputs of 1 to 16, packed"),
    ("trainer-reference", "pytorch-trainer-reference", "reference size (d_model 128, 3 layers)"),
]


def training(out):
    """The trainer's lines (`--trainer`): its steps on wgpu, on the CPU and PyTorch's on CUDA,
    then each whole default run's summary."""
    lines = []
    steps = {}
    for name, column in (("trainer-wgsl", "wgpu (WGSL)"), ("trainer-flex", "flex (this CPU)")):
        for r in load(os.path.join(out, name + ".json")) or []:
            if r.get("pass") == "train-step":
                steps.setdefault(r["subject"], {})[column] = r
    torch = load(os.path.join(out, "pytorch-trainer.json")) or {}
    for r in torch.get("records", []):
        steps.setdefault(r["subject"], {})["PyTorch CUDA"] = r
    if steps:
        lines.append("\n## Training steps, batch 64: ms per step (tokens/s)\n")
        columns = ["wgpu (WGSL)", "flex (this CPU)", "PyTorch CUDA"]
        lines.append("| steps | " + " | ".join(columns) + " |")
        lines.append("|---|" + "---|" * len(columns))
        for subject, torch_subject, what in TRAINER_ROWS:
            cells = dict(steps.get(subject, {}))
            if torch_subject in steps:
                cells.update(steps[torch_subject])
            if not cells:
                continue
            row = []
            for c in columns:
                r = cells.get(c)
                row.append("—" if r is None else f"{cell(ms_of(r))} ({r.get('tokens_per_second') or 0:.0f})")
            lines.append(f"| {what} | " + " | ".join(row) + " |")
    runs = sorted(glob.glob(os.path.join(out, "train-*", "summary.json")))
    if runs:
        lines.append("\n## The trainer's whole run on wgpu (the default task, reverse; 1000 steps unless the dry run)\n")
        lines.append("| build | status | steps | held-out exact accuracy | token accuracy | training s | steps/s | tokens/s |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for path in runs:
            build = os.path.basename(os.path.dirname(path))[len("train-"):]
            r = load(path) or {}
            pct = lambda x: "—" if x is None else f"{100 * x:.2f}%"
            wall = r.get("wall_seconds") or 0
            rate = f"{r.get('steps_done', 0) / wall:.1f}" if wall else "—"
            # A run stopped by its step's limit leaves the status it had while running.
            status = {"running": "stopped before the end"}.get(r.get("status"), r.get("status", "—"))
            lines.append(
                f"| {build} | {status} | {r.get('steps_done', '—')} | {pct(r.get('exact_accuracy'))} "
                f"| {pct(r.get('token_accuracy'))} | {wall:.1f} | {rate} | {r.get('tokens_per_second') or 0:.0f} |"
            )
    return lines


def log_tables(out, step, title, header, headings=None):
    """The tables of the benchmark's OUT/STEP-BUILD.log (`--floor`, `--overhead`,
    `--decode`), a section for each build named by `title`: the log's sections whose
    heading (a line `## ...`) holds one of `headings` (`STEP` where not given), each
    heading one level down, each table (a line starting with `header`) apart from the one
    before it. The log's other sections (the table of the shapes a `--floor` step prints
    after its own) are left out."""
    lines = []
    for path in sorted(glob.glob(os.path.join(out, f"{step}-*.log"))):
        build = os.path.basename(path)[len(step) + 1:-len(".log")]
        lines.append("\n## " + title.format(build))
        inside = False
        with open(path) as f:
            for line in f:
                if line.startswith("## "):
                    inside = any(h in line for h in (headings or [step]))
                    if inside:
                        lines.extend(["", "#" + line.rstrip("\n")])
                elif inside and line.startswith(header):
                    lines.extend(["", line.rstrip("\n")])
                elif inside and line.startswith("|"):
                    lines.append(line.rstrip("\n"))
    return lines


# The kernels whose tiles `--tiles` sweeps: the name the device's timestamps give each
# (its `#[cube]` function's), and the name MHA_GPU_TILES and the "tiles taken" line give.
SWEPT_KERNELS = [("ForwardKernel", "forward", "forward"), ("DqKernel", "dq", "dQ"), ("DkvKernel", "dkv", "dK/dV")]


def sweep_steps(out, build):
    """Each `--tiles` step of BUILD under OUT that ran whole as (dtype, tiles first, log
    path), in order: not one that steps.tsv names as anything but ok (failed, timed out), nor
    one whose JSON names a measurement that failed (a result not finite: tiles that gave
    wrong numbers must not be chosen for their speed)."""
    status = {}
    if os.path.exists(os.path.join(out, "steps.tsv")):
        with open(os.path.join(out, "steps.tsv")) as f:
            for line in f:
                name, state = (line.rstrip("\n").split("\t") + [""])[:2]
                status[name] = state
    steps = []
    for path in glob.glob(os.path.join(out, f"tiles-{build}-*.log")):
        name = os.path.basename(path)[:-len(".log")]
        records = load(os.path.join(out, name + ".json"))
        if status.get(name, "ok") != "ok" or records is None or any(r.get("failed") for r in records):
            continue
        dtype, *first = name[len(f"tiles-{build}-"):].split("-")
        steps.append((dtype, ",".join(first), path))
    return sorted(steps)


def sweep_log(path):
    """One `--tiles` step's log as (tiles taken, kernels): the first "tiles taken" line's
    list of each kernel's tiles (`forward 64,32,32 portable, dQ ...`) and the core's
    kernel-by-kernel column (`` `ForwardKernel<..>` (1): 2.39; ... ``), None where absent."""
    taken = kernels = None
    with open(path) as f:
        for line in f:
            if line.startswith("| core |"):
                kernels = line.rstrip("\n").rstrip(" |").split(" | ")[-1]
            elif "tiles taken" in line and taken is None:
                taken = line.rsplit(" inputs: ", 1)[-1].strip()
    return taken, kernels


def swept(path):
    """What one `--tiles` step's log says: {kernel: (tiles taken, device ms)} for each kernel
    the step both names the tiles of and timed ([`sweep_log`])."""
    said_taken, said_kernels = sweep_log(path)
    taken, times = {}, {}
    for _, key, said in SWEPT_KERNELS:
        m = re.search(re.escape(said) + r" (\d+,\d+,\d+)", said_taken or "")
        if m:
            taken[key] = m.group(1)
    for entry in (said_kernels or "").split("; "):
        m = re.match(r"`(\w+)[^`]*` \((\d+)\): ([\d.]+)", entry.strip())
        for name, key, _ in SWEPT_KERNELS:
            if m and m.group(1) == name:
                times[key] = times.get(key, 0.0) + float(m.group(3))
    return {k: (taken[k], times[k]) for k in taken if k in times}


def best_tiles(out, build):
    """The MHA_GPU_TILES setting that gives each kernel of BUILD, in each dtype `--tiles`
    swept it in, the tiles it took in the step where its own device time was least
    (`KERNEL@DTYPE=U,Q,K`, `;` between them), and a line for each choice saying what it
    beat; ("", []) where no step of BUILD timed a kernel. A kernel timed with one tiles
    only (a sweep the budget cut) is left as it is unasked: nothing was compared."""
    best = {}
    for dtype, first, path in sweep_steps(out, build):
        for kernel, (tiles, ms) in swept(path).items():
            best.setdefault((kernel, dtype), []).append((ms, tiles, first))
    setting, why = [], []
    order = [key for _, key, _ in SWEPT_KERNELS]
    for (kernel, dtype), seen in sorted(best.items(), key=lambda kv: (kv[0][1], order.index(kv[0][0]))):
        seen.sort()
        ms, tiles, _ = seen[0]
        if len({t for _, t, _ in seen}) < 2:
            why.append(f"{build} {dtype} {kernel}: only {tiles} timed ({ms:.2f} ms): left as it is unasked")
            continue
        setting.append(f"{kernel}@{dtype}={tiles}")
        others = ", ".join(f"{t} {m:.2f}" for m, t, _ in seen[1:])
        why.append(f"{build} {dtype} {kernel}: {tiles} at {ms:.2f} ms" + (f" (then {others})" if others else ""))
    return ";".join(setting), why


def asked_tiles(out):
    """The tiles each step asked for (OUT/tiles.tsv, `gpu_table.sh` with
    MHA_GPU_TABLE_TILES or in its dry run: build, setting, and why each was chosen)."""
    path = os.path.join(out, "tiles.tsv")
    if not os.path.exists(path):
        return []
    lines = ["\n## Tiles asked for (MHA_GPU_TILES, from a `--tiles` sweep: each kernel's fastest)\n"]
    with open(path) as f:
        for line in f:
            lines.append("- " + line.rstrip("\n").replace("\t", ": ", 1).replace("\t", "; "))
    return lines


COLUMNS = [
    ("mha wgsl", "mha (WGSL)"),
    ("mha spirv", "mha (SPIR-V)"),
    ("mha spirv_portable", "mha (SPIR-V, portable product)"),
    ("core+linear wgsl", "core + 3 Linear (WGSL)"),
    ("core+qkv wgsl", "core + 1 Linear to QKV (WGSL)"),
    ("core-bthd wgsl", "mha core on [B, T, H, Dh] views (WGSL)"),
    ("burn wgsl", "Burn (WGSL)"),
    ("burn spirv", "Burn (SPIR-V)"),
    ("pytorch", "PyTorch CUDA"),
    ("mha-core wgsl", "mha core (WGSL)"),
    ("mha-core spirv", "mha core (SPIR-V)"),
    ("mha-core spirv_portable", "mha core (SPIR-V, portable product)"),
    ("pytorch-core", "PyTorch core"),
]

SHAPE_ORDER = {"tiny": 0, "small": 1, "base": 2, "long": 3}


def table(rows):
    """The lines of the table of `rows` ((shape, pass, dtype) -> {column: ms or
    "failed"}): a column for each of COLUMNS that has a value, and the ratios of Burn's
    and PyTorch's best times to mha's."""
    present = [c for c in COLUMNS if any(c[0] in v for v in rows.values())]
    header = ["shape", "pass", "dtype"] + [name for _, name in present] + ["Burn/mha", "PyTorch/mha"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (shape, pass_, dtype), cells in sorted(rows.items(), key=lambda kv: (SHAPE_ORDER.get(kv[0][0], 9), kv[0][0], kv[0][1], kv[0][2])):
        timed = lambda keys: [cells[k] for k in keys if isinstance(cells.get(k), (int, float))]
        mine = min(timed(("mha wgsl", "mha spirv")), default=None)
        burn = min(timed(("burn wgsl", "burn spirv")), default=None)
        torch_ms = cells.get("pytorch") if isinstance(cells.get("pytorch"), (int, float)) else None
        ratio = lambda other: f"{other / mine:.2f}" if mine and other else "—"
        values = [cell(cells[key]) if key in cells else "—" for key, _ in present]
        lines.append("| " + " | ".join([shape, pass_, dtype] + values + [ratio(burn), ratio(torch_ms)]) + " |")
    return lines


def main(out):
    # (shape, pass, dtype) -> {column: ms or "failed"}: synced after each call, and
    # queued (where the records have it).
    rows = {}
    queued = {}
    long_rows = []
    failures = []
    for path in sorted(glob.glob(os.path.join(out, "mha-*.json"))):
        build = os.path.basename(path)[len("mha-"):].split("-")[0]
        records = load(path) or []
        # A file of a run with `--queued`: its calls that failed are failed queued too.
        was_queued = any("queued_ms" in r or "queued_failed" in r for r in records)
        for r in records:
            shape = (r.get("shape") or {}).get("name")
            if not shape or not r.get("dtype"):
                continue
            if r.get("failed"):
                failures.append((build, r["subject"], r["pass"], shape, r["dtype"], r["failed"]))
            elif r.get("queued_failed"):
                failures.append((build, f"{r['subject']} (queued)", r["pass"], shape, r["dtype"], r["queued_failed"]))
            column = f"{r['subject']} {build}"
            queued_ms = ms_of(r, "queued_ms") if was_queued else None
            if shape == "long-core":
                long_rows.append((f"mha {build}", r.get("context"), r["dtype"], ms_of(r), queued_ms, r.get("peak_mib")))
                continue
            rows.setdefault((shape, r["pass"], r["dtype"]), {})[column] = ms_of(r)
            if queued_ms is not None:
                queued.setdefault((shape, r["pass"], r["dtype"]), {})[column] = queued_ms
    torch = load(os.path.join(out, "pytorch.json"))
    for r in (torch or {}).get("records", []):
        if r.get("shape") == "long-core":
            long_rows.append(("PyTorch CUDA", r.get("context"), r["dtype"], r["median_ms"], r.get("queued_ms"), r.get("peak_mib")))
            continue
        rows.setdefault((r["shape"], r["pass_"], r["dtype"]), {})[r["subject"]] = r["median_ms"]
        if r.get("queued_ms") is not None:
            queued.setdefault((r["shape"], r["pass_"], r["dtype"]), {})[r["subject"]] = r["queued_ms"]

    lines = []
    if torch:
        lines.append(f"PyTorch {torch.get('torch')} on {torch.get('device')}.\n")
    if rows:
        lines.append("## Causal self-attention, median ms, synced after each call (lower is better)\n")
        lines.extend(table(rows))
    # A forward+backward that took less than its forward alone: one of the two met the
    # device away from its clocks (on an H200, 2026-11-28, the forward measured first
    # after the host had compiled for a new shape), or is wrong; said under the table.
    suspect = []
    for (shape, pass_, dtype), cells in sorted(rows.items()):
        forward = rows.get((shape, "forward", dtype), {})
        for key, name in COLUMNS if pass_ == "forward+backward" else []:
            fwd, both = forward.get(key), cells.get(key)
            if isinstance(fwd, (int, float)) and isinstance(both, (int, float)) and both < fwd:
                suspect.append(f"- {name}, {shape}, {dtype}: forward {fwd:.2f} ms, forward+backward {both:.2f}")
    if suspect:
        lines.append("\nSuspect: forward+backward faster than the forward alone (a measurement away from the device's clocks?):\n")
        lines.extend(suspect)
    if queued:
        lines.append("\n## The same calls queued: median ms per call, calls issued back to back before one sync (`--queued`)\n")
        lines.extend(table(queued))
    if long_rows:
        lines.append("\n## Causal core alone, batch 1, 8 heads of 64, forward+backward\n")
        lines.append("Peak MiB: the device memory held at the peak, `mha`'s memory pool's pages and PyTorch's caching allocator's reserved memory.\n")
        lines.append("| who | positions | dtype | median ms | queued ms per call | peak MiB |")
        lines.append("|---|---|---|---|---|---|")
        for who, positions, dtype, ms, queued_ms, peak in long_rows:
            peak = "—" if peak is None else f"{peak:.0f}"
            queued_ms = "—" if queued_ms is None else cell(queued_ms)
            lines.append(f"| {who} | {positions} | {dtype} | {cell(ms)} | {queued_ms} | {peak} |")
    lines.extend(log_tables(out, "floor", "The floor of a call ({}): next to nothing to compute", "| call |"))
    lines.extend(log_tables(out, "overhead", "Around the kernels ({}): one call of each module", "| module |"))
    lines.extend(log_tables(out, "decode", "One decoding step ({}: `_tiles` on the tiled forward, else on the decoding kernels)", "| batch |", ["one decoding step", "the attention core in a decoding step"]))
    def tiles_key(path):
        build, dtype, *first = os.path.basename(path)[len("tiles-"):-len(".log")].split("-")
        return (build, dtype, [int(x) if x.isdigit() else 0 for x in first])

    tile_logs = sorted(glob.glob(os.path.join(out, "tiles-*.log")), key=tiles_key)
    if tile_logs:
        lines.append("\n## The causal core with each tile first (MHA_GPU_TILES), forward+backward\n")
        lines.append("| build | dtype | tiles first | tiles taken | positions | median ms | kernel (launches): ms |")
        lines.append("|---|---|---|---|---|---|---|")
        for log in tile_logs:
            build, dtype, first = tiles_key(log)
            taken, kernels = (said or "—" for said in sweep_log(log))
            records = [r for r in load(log[:-len(".log")] + ".json") or [] if (r.get("shape") or {}).get("name") == "long-core"]
            first = ",".join(map(str, first))
            for r in records:
                if r.get("failed"):
                    failures.append((f"{build}, tiles {first}", r["subject"], r["pass"], f"{r.get('context')} positions", dtype, r["failed"]))
            for r in records or [{}]:
                ms = cell(ms_of(r)) if "median_ms" in r else "—"
                lines.append(f"| {build} | {dtype} | {first} | {taken} | {r.get('context', '—')} | {ms} | {kernels} |")
    lines.extend(asked_tiles(out))
    lines.extend(training(out))
    if failures:
        lines.append("\n## Measurements that failed (the device did not complete the call, or its result was not finite)\n")
        lines.append("| build | subject | pass | shape | dtype | why |")
        lines.append("|---|---|---|---|---|---|")
        for failure in failures:
            lines.append("| " + " | ".join(str(x).replace("|", "/").replace("\n", " ") for x in failure) + " |")
    steps = os.path.join(out, "steps.tsv")
    if os.path.exists(steps):
        lines.append("\n## Steps\n")
        lines.append("| step | status | seconds |")
        lines.append("|---|---|---|")
        with open(steps) as f:
            for line in f:
                name, status, seconds = (line.rstrip("\n").split("\t") + ["", "", ""])[:3]
                lines.append(f"| {name} | {status} | {seconds} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "gpu_table.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--best-tiles":
        setting, why = best_tiles(sys.argv[2], sys.argv[3])
        print(setting)
        if why:
            print("\n".join(why), file=sys.stderr)
    elif len(sys.argv) == 2:
        print(main(sys.argv[1]), end="")
    else:
        sys.exit(__doc__)
