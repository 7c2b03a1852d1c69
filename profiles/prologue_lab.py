"""Lab: the two kernels before the fused launch (the forward's prologue), each alone: the cumsum
stages and the gate-free solve at every number of value heads a CTA.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/prologue_lab.py measure OUT.csv [--commit SHA]

For each head layout of ``flashqla.testing.PUBLIC_HEADS`` and one sequence of 2048 or 8192
tokens, one row per kernel:

    problem        the problem's label
    kernel         ``chunk_local_cumsum.s01`` / ``.s02``; ``gate_free_solve.s06/R`` or ``.s08/R``
                   at R value heads a CTA (every R up to 4 that divides HV / H)
    ctas           the launch's CTAs (the solve: chunks x HV / R; the cumsum: chunks)
    us             microseconds a launch: 50 launches on the same inputs captured in one CUDA
                   graph, the replay's time / 50, median of 5 replays (one launch a graph would
                   time the graph's own overhead, about 17 us, not the kernel)

plus the provenance columns of ``flashqla.bench.versions`` and ``method``. Alone, a launch's tail
overlaps only the next launch of the same kernel; inside the forward the solve runs once, between
the cumsum and the fused kernel, and its time is one launch's latency. So

    python3 profiles/prologue_lab.py forward OUT.csv [--commit SHA]

times the solve there: for the same problems and every grouping R, the library's forward
(``flashqla.chunk_gated_delta_rule``) with ``flashqla.fwd.solve_heads`` forced to R (at R <= 2 one
kernel, the cumsum in s08's solve: gate_free_solve.s13's at s14's CTAs an SM; above, the cumsum
kernel and s06's, as the library runs them), captured in a CUDA graph, 20 replays under
torch.profiler (``timeline_lab.py``'s method); ``us`` is the device time a replay of the cumsum and
the solve, ``forward_us`` the replay's span from its first kernel's start to its last one's end
(``results/solve_in_forward.csv``, commit b37aa0a, is older: it times the solve alone, s08's kernel
at R <= 2). On any machine,

    python3 profiles/prologue_lab.py report IN.csv

prints each problem's kernels on one line. ``results/prologue.csv`` (one H100, commit 677241e) is
quoted in gate_free_solve.s10's and chunk_local_cumsum.s02's docstrings; it was measured by a
script of the same method and kernels that this lab was then written from.
``results/solve_in_forward.csv`` is this lab's ``forward`` (one H100, commit b37aa0a), quoted in
gate_free_solve.s11's docstring.
"""

import argparse
import csv
import sys
from pathlib import Path

LAUNCHES = 50      # kernel launches captured in one graph
REPLAYS = 5        # graph replays timed; the median is kept
LENGTHS = (2048, 8192)
METHOD = f"{LAUNCHES} launches in one CUDA graph, replay time / {LAUNCHES}, median of {REPLAYS}"


def graph_us(fn) -> float:
    """Microseconds a call of ``fn``: LAUNCHES calls captured in one graph, replayed REPLAYS times."""
    import torch

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(LAUNCHES):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAUNCHES)
    return sorted(times)[REPLAYS // 2]


def kernels(H: int, HV: int):
    """(name, stage module, compile arguments, is_solve) of every kernel variant this lab times."""
    from flashqla import stages

    out = [(f"chunk_local_cumsum.s{n:02d}", stages.load("chunk_local_cumsum", n), (HV,), False) for n in (1, 2)]
    for n in (6, 8):
        mod = stages.load("gate_free_solve", n)
        out += [(f"gate_free_solve.s{n:02d}/{R}", mod, (H, HV, R), True)
                for R in (1, 2, 3, 4) if (HV // H) % R == 0]
    return out


def measure(out: Path, commit: str) -> int:
    import torch

    from flashqla import bench
    from flashqla.testing import PUBLIC_HEADS, Problem, run_on_threads
    from flashqla.varlen import chunk_table

    run_on_threads([lambda m=mod, a=args: m._compiled(*a) for H, HV in PUBLIC_HEADS
                    for _, mod, args, _ in kernels(H, HV)])
    meta = bench.versions(commit)
    rows = []
    for H, HV in PUBLIC_HEADS:
        for n in LENGTHS:
            p = Problem(H, HV, (n,))
            x = p.inputs("cuda")
            B, T = x["k"].shape[:2]
            k = x["k"].view(B * T, H, 128)
            beta, g = x["beta"].view(B * T, HV), x["g"].view(B * T, HV).contiguous()
            bounds, _ = chunk_table(x["cu_seqlens"], B, T, 64, k.device)
            g_cum = torch.empty_like(g)
            ab = torch.empty(B * T, HV, 64, dtype=torch.bfloat16, device="cuda")
            gated = torch.empty(bounds.shape[0], HV, dtype=torch.int32, device="cuda")
            for name, mod, args, is_solve in kernels(H, HV):
                kernel = mod._compiled(*args)
                if is_solve:
                    us = graph_us(lambda: kernel(k, beta, g_cum, bounds, ab, gated))
                    ctas = bounds.shape[0] * HV // args[2]
                else:
                    us = graph_us(lambda: kernel(g, bounds, g_cum))
                    ctas = bounds.shape[0]
                rows.append(dict(problem=p.label, kernel=name, ctas=ctas, us=round(us, 1), method=METHOD, **meta))
            print(report_line(p.label, [r for r in rows if r["problem"] == p.label]), flush=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


FORWARD_METHOD = ("the library's forward in one CUDA graph, solve_heads forced; kernel device time "
                  "and span under torch.profiler, mean of 20 replays (timeline_lab.timeline)")


def forward_times(x) -> tuple[float, float]:
    """(the cumsum's and solve's us, the forward's span in us) a replay of the library's forward
    (``timeline_lab.timeline``)."""
    from timeline_lab import timeline  # beside this file: python3 puts profiles/ on the path

    from flashqla.api import chunk_gated_delta_rule

    rows = timeline(lambda inputs: chunk_gated_delta_rule(**inputs), x)
    return (sum(r["us"] for r in rows if "gate_free_solve" in r["kernel"] or "cumsum" in r["kernel"]),
            rows[0]["span_us"])


def measure_forward(out: Path, commit: str) -> int:
    from unittest import mock

    from flashqla import bench, fwd
    from flashqla.api import chunk_gated_delta_rule
    from flashqla.testing import PUBLIC_HEADS, Problem, run_on_threads
    from flashqla.varlen import num_chunk_rows

    problems = [Problem(H, HV, (n,)) for H, HV in PUBLIC_HEADS for n in LENGTHS]
    groupings = {p.label: [R for R in (1, 2, 3, 4) if (p.HV // p.H) % R == 0] for p in problems}
    inputs = {p.label: p.inputs("cuda") for p in problems}
    run_on_threads([lambda p=p, R=R: fwd._compiled(
        fwd.gate_free_solve_with_cumsum_kernel if R <= fwd.SOLVE_TF32_MAX_HEADS else fwd.gate_free_solve_kernel,
        p.H, p.HV, R) for p in problems for R in groupings[p.label]])
    run_on_threads([lambda x=x: chunk_gated_delta_rule(**x) for x in inputs.values()])
    meta = bench.versions(commit)
    rows = []
    for p in problems:
        rows_p = num_chunk_rows(inputs[p.label]["cu_seqlens"], 1, max(p.lengths), 64)
        for R in groupings[p.label]:
            with mock.patch.object(fwd, "solve_heads", lambda *_, R=R: R):
                us, span = forward_times(inputs[p.label])
            stage = "s14" if R <= fwd.SOLVE_TF32_MAX_HEADS else "s06"
            rows.append(dict(problem=p.label, kernel=f"gate_free_solve.{stage}/{R}", ctas=rows_p * p.HV // R,
                             us=round(us, 1), forward_us=round(span, 1), method=FORWARD_METHOD, **meta))
        print(report_line(p.label, [r for r in rows if r["problem"] == p.label]), flush=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


def report_line(label: str, rows: list[dict]) -> str:
    short = {"chunk_local_cumsum": "cumsum", "gate_free_solve": "solve"}
    return f"{label:18s} " + "  ".join(
        f"{short[r['kernel'].split('.')[0]]} {r['kernel'].split('.')[1]} {float(r['us']):5.1f}" for r in rows)


def report(path: Path) -> int:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for label in dict.fromkeys(r["problem"] for r in rows):
        print(report_line(label, [r for r in rows if r["problem"] == label]))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_measure = sub.add_parser("measure")
    p_measure.add_argument("out", type=Path)
    p_measure.add_argument("--commit", default="unknown")
    p_forward = sub.add_parser("forward")
    p_forward.add_argument("out", type=Path)
    p_forward.add_argument("--commit", default="unknown")
    p_report = sub.add_parser("report")
    p_report.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args.out, args.commit)
    if args.command == "forward":
        return measure_forward(args.out, args.commit)
    return report(args.path)


if __name__ == "__main__":
    sys.exit(main())
