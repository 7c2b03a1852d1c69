"""Lab: where a training step's GPU time goes, kernel by kernel, for the library and for any
gdn_bwd stage run after the library's forward (the rows of ``python -m flashqla bench --mode
gdn_train``).

On the GPU machine, from the project root:

    python3 profiles/bwd_breakdown_lab.py --commit $(git rev-parse --short HEAD) \
        --rows flashqla.chunk_gated_delta_rule "fwd + gdn_bwd/s05_prep_on_solve" \
        --problems "(16, 64) 8x4096" "(2, 8) 1x32768"

For each (row, problem): three untimed steps, then STEPS steps under torch.profiler (CUDA activity
and CPU activity); every kernel's device time summed over them and divided by STEPS: milliseconds
a step, and launches a step. Before the profile, the wall time of STEPS back-to-back eager steps
(one synchronization at the end) over STEPS, ``eager_ms``: where it exceeds the kernels' sum, the
host is the bound, and the run prints the host operations with the most self CPU time a step.
The upstream gradients are the bench's (``bench.input_sets``' first set: random do and dht), so
no fill or accumulation kernel of the lab's own enters the rows. Writes
``profiles/results/bwd_breakdown.csv`` (or ``--csv``): problem, row, kernel, ms a step, launches a
step, the step's kernel total, eager_ms, and the bench's provenance columns. Profiler times are each
kernel's own duration, back to back; gaps between kernels are not in them, so a row's total is at
most its CUDA-graph step time (``gdn_train.csv``)."""

import argparse
import collections
import csv
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashqla import bench
from flashqla.testing import Problem

STEPS = 5
RESULTS = Path(__file__).resolve().parent / "results" / "bwd_breakdown.csv"
COLUMNS = ("problem", "row", "kernel", "ms", "launches", "step_kernels_ms", "eager_ms")


def per_kernel(events, steps: int) -> list[tuple[str, float, int]]:
    """(kernel name, ms a step, launches a step) of the CUDA kernel events, largest first."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total
            count[e.name] += 1
    return [(name, us / 1e3 / steps, count[name] // steps) for name, us in total.most_common()]


def host_ops(events, steps: int, top: int = 8) -> list[tuple[str, float]]:
    """(host operation, self CPU ms a step) of the CPU events, the ``top`` largest."""
    total = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            total[e.name] += e.self_cpu_time_total
    return [(name, us / 1e3 / steps) for name, us in total.most_common(top)]


def breakdown(step, x: dict) -> tuple[list[tuple[str, float, int]], float, list[tuple[str, float]]]:
    """(``per_kernel``, eager ms a step, ``host_ops``) of STEPS calls of ``step(x)``, after three
    untimed ones."""
    for _ in range(3):
        step(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step(x)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) * 1e3 / STEPS
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(x)
        torch.cuda.synchronize()
    events = prof.events()
    return per_kernel(events, STEPS), eager, host_ops(events, STEPS)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--rows", nargs="+", default=[bench.API_ROW])
    ap.add_argument("--problems", nargs="+", default=["(16, 64) 8x4096", "(2, 8) 1x32768"])
    ap.add_argument("--csv", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rows = {name: fn for name, fn, *_ in bench.TRAINING.candidates()}
    unknown = set(args.rows) - set(rows)
    if unknown:
        raise ValueError(f"--rows {sorted(unknown)} are not training rows: {sorted(rows)}")
    meta = bench.versions(args.commit)
    out = []
    for label in args.problems:
        H, HV, lengths = bench.heads_and_lengths(label)
        x = bench.input_sets(Problem(H, HV, tuple(lengths)), 0, training=True)[0]
        for name in args.rows:
            kernels, eager, host = breakdown(rows[name], x)
            step_ms = round(sum(ms for _, ms, _ in kernels), 3)
            print(f"## {label}  {name}: {step_ms} ms of kernels a step, {eager:.3f} ms eager", flush=True)
            for kernel, ms, n in kernels:
                print(f"  {ms:8.3f} ms  x{n}  {kernel[:90]}")
                out.append(dict(problem=label, row=name, kernel=kernel, ms=round(ms, 4), launches=n,
                                step_kernels_ms=step_ms, eager_ms=round(eager, 3), **meta))
            if eager > step_ms:
                top = "; ".join(f"{op[:50]} {ms:.3f}" for op, ms in host)
                print(f"  host, self CPU ms a step (profiled): {top}")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
