"""Lab: one forward's kernel timeline inside a CUDA graph, beside FlashQLA's: each kernel's device
time and the gap before it.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/timeline_lab.py measure OUT.csv [--commit SHA] [--impls gdn_fwd.27 API FlashQLA]
        [--problems LABEL ...]

For each problem (``problems``' default set, or the benchmark problems named) and each implementation (a gdn_fwd stage ``gdn_fwd.NN``, the library's
entry point ``API``, ``FlashQLA``): three eager calls, one forward captured in a CUDA graph, five
replays, then REPLAYS replays under torch.profiler (each followed by a synchronize). One row per
kernel of the forward, in launch order:

    problem, impl    the problem's label and the implementation
    position         the kernel's place in the forward (0 first)
    kernel           its name as the profiler reports it (first 70 characters)
    grid, block      its launch shape
    us               its device time, start to end, mean over the replays; with programmatic
                     dependent launch (gdn_fwd.s27 on) a kernel starts before its predecessor
                     ends and this includes its wait
    gap_us           its start minus the previous kernel's end (negative: it started earlier)
    span_us          the forward's span, first kernel's start to last kernel's end

plus the provenance columns of ``flashqla.bench.versions`` and ``method``. On any machine,

    python3 profiles/timeline_lab.py report IN.csv

prints the timelines. ``results/timeline.csv`` (one H100, commit ab90d41: gdn_fwd.s27, the API on
s26's kernels, FlashQLA) is quoted in gdn_fwd.s27's and s28's docstrings; it came from the run of
the script this lab was written from, with the same method, printed and then tabulated.
``results/timeline_weak_rows.csv`` (one H100, commit 2066b86: the API, s40's library, and FlashQLA
on (16, 16) 8x4096, (8, 24) 28672+4096, (16, 64) 8x4096, (8, 24) 1x2048 and (8, 32) 1x8192; that
run replaced the problem list in-process, as ``--problems`` now does) is quoted in gdn_fwd.s42's
docstring and the README's gaps.
"""

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

REPLAYS = 20
METHOD = (f"one forward in a CUDA graph; kernel device times and gaps under torch.profiler, mean of "
          f"{REPLAYS} replays")


def problems(labels=()):
    """PROBLEMS' default set, or the benchmark's problems with these short labels (e.g. "(16, 16) 8x4096")."""
    from flashqla import bench
    from flashqla.testing import Problem

    if labels:
        by_label = {bench.short_label(p.label): p for p in bench.PROBLEMS}
        unknown = [lab for lab in labels if lab not in by_label]
        if unknown:
            raise ValueError(f"timeline_lab: `--problems` {unknown} are not benchmark problems")
        return [by_label[lab] for lab in labels]
    return ([Problem(H, HV, (2048,)) for H, HV in ((2, 8), (4, 16), (8, 32), (8, 24), (16, 16), (16, 64))]
            + [Problem(2, 8, (8192,)), Problem(16, 48, (8192,))])


def implementation(name):
    """fn(inputs dict) for ``gdn_fwd.NN``, ``API`` or ``FlashQLA``."""
    if name == "FlashQLA":
        import flash_qla

        return lambda x: flash_qla.chunk_gated_delta_rule(**x)
    if name == "API":
        from flashqla.api import chunk_gated_delta_rule

        return lambda x: chunk_gated_delta_rule(**x)
    from flashqla import stages

    op, number = name.split(".")
    module = stages.load(op, int(number))
    return lambda x: module.run(**x)


def timeline(fn, x) -> list[dict]:
    """One replay's kernels: position, kernel, grid, block, us, gap_us, span_us (means)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"]
                  if e.get("cat") == "kernel" and e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    n = len(events) // REPLAYS
    assert n * REPLAYS == len(events), f"{len(events)} kernels in {REPLAYS} replays"
    runs = [events[r * n:(r + 1) * n] for r in range(REPLAYS)]
    span = sum(run[-1]["ts"] + run[-1]["dur"] - run[0]["ts"] for run in runs) / REPLAYS
    rows = []
    for i, e in enumerate(runs[0]):
        gap = sum(run[i]["ts"] - run[i - 1]["ts"] - run[i - 1]["dur"] for run in runs) / REPLAYS if i else 0.0
        rows.append(dict(position=i, kernel=e["name"][:70], grid=e["args"].get("grid"), block=e["args"].get("block"),
                         us=round(sum(run[i]["dur"] for run in runs) / REPLAYS, 1), gap_us=round(gap, 1),
                         span_us=round(span, 1)))
    return rows


def measure(out: Path, commit: str, impls: list[str], labels=()) -> int:
    from flashqla import bench
    from flashqla.testing import run_on_threads

    fns = {name: implementation(name) for name in impls}
    chosen = problems(labels)
    inputs = [p.inputs("cuda", seed=0) for p in chosen]
    for name, fn in fns.items():  # compile every kernel shape first, many at a time (FlashQLA: its own JIT)
        if name != "FlashQLA":
            run_on_threads([lambda x=x, fn=fn: fn(x) for x in inputs])
    meta = bench.versions(commit) | {"method": METHOD}
    rows = []
    for p, x in zip(chosen, inputs):
        for name, fn in fns.items():
            rows += [dict(problem=p.label, impl=name, **r, **meta) for r in timeline(fn, x)]
            print(report_block([r for r in rows if r["problem"] == p.label and r["impl"] == name]), flush=True)
        with open(out, "w", newline="") as f:  # after every problem: a run cut short keeps what it measured
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report_block(rows: list[dict]) -> str:
    head = f"== {rows[0]['problem']} {rows[0]['impl']}: span {float(rows[0]['span_us']):.1f} us, {len(rows)} kernels"
    return "\n".join([head] + [f"   {float(r['us']):8.1f} us  gap-before {float(r['gap_us']):6.1f}  {r['kernel']}"
                               for r in rows])


def report(path: Path) -> int:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for key in dict.fromkeys((r["problem"], r["impl"]) for r in rows):
        print(report_block([r for r in rows if (r["problem"], r["impl"]) == key]))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_measure = sub.add_parser("measure")
    p_measure.add_argument("out", type=Path)
    p_measure.add_argument("--commit", default="unknown")
    p_measure.add_argument("--impls", nargs="+", default=["gdn_fwd.27", "API", "FlashQLA"])
    p_measure.add_argument("--problems", nargs="+", default=(), help='benchmark problems, e.g. "(16, 16) 8x4096"')
    p_report = sub.add_parser("report")
    p_report.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args.out, args.commit, args.impls, args.problems)
    return report(args.path)


if __name__ == "__main__":
    sys.exit(main())
