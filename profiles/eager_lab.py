"""Lab: what an eager call costs on the host, beside CUDA-graph replay, for the API and FlashQLA.

On the GPU machine, from the project root (TileLang, flash-qla installed):

    python3 profiles/eager_lab.py OUT.csv [--commit SHA] [--problems LABEL ...] [--profile OUT.txt]

For each problem (the benchmark's forward problems and short varlen mixes) and each row (the API,
FlashQLA), under ``torch.no_grad`` as in inference, on the benchmark's rotating input sets:

    graph_ms   median of CUDA-graph replays of one call (``flashqla.bench``'s method)
    eager_ms   one call in a loop of back-to-back eager calls: the loop's wall time over its calls,
               synchronized once at the end (what a user's eager loop runs at: the larger of the
               host's issue time and the GPU's time, plus what does not overlap)
    host_ms    the host's time to issue one call (the same loop, before its synchronize, over its
               calls): when it exceeds graph_ms, the call is host-bound
    eager_over_graph   eager_ms / graph_ms

plus the provenance columns of ``flashqla.bench.versions``. ``--profile`` writes cProfile's
top functions (by own time) of 300 eager API calls on the first problem: where the host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashqla import bench  # noqa: E402
from flashqla.testing import PUBLIC_HEADS, Problem, run_on_threads  # noqa: E402

SHORT_MIXES = ((1024, 1024), (512, 1536), (256,) * 8, (100, 900, 1048))
PROBLEMS = [Problem(H, HV, mix) for H, HV in PUBLIC_HEADS for mix in SHORT_MIXES] + list(bench.PROBLEMS)
LOOP = 200  # eager calls a timing loop


def rows():
    from flashqla.api import chunk_gated_delta_rule

    out = [(bench.API_ROW, lambda x: chunk_gated_delta_rule(**x))]
    try:
        import flash_qla

        out.append((bench.FLASHQLA_ROW, lambda x: flash_qla.chunk_gated_delta_rule(**x)))
    except ImportError:
        pass
    return out


def eager_and_host_ms(fn, sets) -> tuple[float, float]:
    """(wall ms a call of a back-to-back loop, host ms a call before the loop's synchronize),
    the median of three loops."""
    walls, hosts = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(LOOP):
            fn(sets[i % len(sets)])
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        walls.append((t2 - t0) * 1e3 / LOOP)
        hosts.append((t1 - t0) * 1e3 / LOOP)
    return statistics.median(walls), statistics.median(hosts)


def profile(fn, sets, path: Path) -> None:
    for x in sets:
        fn(x)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(300):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    path.write_text(text.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv", type=Path)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--problems", nargs="+", default=None)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args(argv)
    problems = PROBLEMS if args.problems is None else [p for p in PROBLEMS if p.label in args.problems]
    cands = rows()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    # compile every head layout's kernels on threads first (one and nine sequences: both widths)
    jobs = [(fn, bench.problem_inputs(Problem(H, HV, lengths), 0)) for H, HV in sorted({(p.H, p.HV) for p in problems})
            for lengths in ((70,), (70,) * 9) for _, fn in cands[:1]]
    with torch.no_grad():
        run_on_threads([lambda job=job: job[0](job[1]) for job in jobs])
    meta = bench.versions(args.commit)
    out = []
    with torch.no_grad():
        if args.profile:
            profile(cands[0][1], bench.input_sets(problems[0], l2), args.profile)
        for p in problems:
            sets = bench.input_sets(p, l2)
            for name, fn in cands:
                graph, method = bench.time_row(fn, sets)
                wall, host = eager_and_host_ms(fn, sets)
                out.append(dict(problem=p.label, impl=name, graph_ms=round(graph, 4),
                                eager_ms=round(wall, 4), host_ms=round(host, 4),
                                eager_over_graph=round(wall / graph, 2), method=method, **meta))
                print(f"{p.label:34} {name:34} graph {graph:8.4f}  eager {wall:8.4f}  host {host:8.4f}",
                      flush=True)
            with open(args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(out[0]))
                w.writeheader()
                w.writerows(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
