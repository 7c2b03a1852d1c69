"""Lab: where a forward's time goes, kernel by kernel (torch.profiler), beside FlashQLA's and FLA's.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/kernel_split_lab.py OUT.csv [--commit SHA]

For each problem of PROBLEMS and each implementation (the entry point ``flashqla.chunk_gated_delta_rule``,
the newest gdn_fwd stage, FlashQLA, FLA), three eager warm-up calls, then ten calls under
torch.profiler; every CUDA kernel's device time is summed and divided by ten. One row per (problem,
implementation, kernel) for its TOP = 8 largest kernels:

    problem, impl       the problem's label; "API", "gdn_fwd.sNN", "FlashQLA" or "FLA"
    kernel              the kernel's name as the profiler reports it (first 90 characters)
    us                  device time per forward call, us
    launches            launches per call
    total_us            the implementation's summed device time per call (launch gaps not counted)

plus the provenance columns of ``flashqla.bench.versions``. Eager calls: kernels that a CUDA graph
would replay are the same, but host-side gaps are not in these sums.

``profiles/results/kernel_split.csv`` holds one run of this lab on one H200 at commit 05f6295, when the
newest stage was gdn_fwd.s13 and the entry point ran s13's pipeline.
"""

import argparse
import collections
import csv
import sys
from pathlib import Path

import torch

from flashqla import bench, stages
from flashqla.testing import Problem

PROBLEMS = [Problem(16, 64, (8192,)), Problem(16, 64, (32768,)), Problem(16, 64, (4096,) * 8),
            Problem(16, 16, (8192,)), Problem(16, 16, (32768,)), Problem(2, 8, (8192,)),
            Problem(16, 64, (2048,))]
CALLS, WARMUP = 10, 3
TOP = 8  # kernels kept per (problem, implementation), the largest
METHOD = f"torch.profiler CUDA device time, mean of {CALLS} eager calls after {WARMUP} warm-up calls"


def implementations():
    from flashqla.api import chunk_gated_delta_rule

    newest = max((s for s in stages.discover() if s.op == "gdn_fwd"), key=lambda s: s.number)
    impls = {"API": lambda x: chunk_gated_delta_rule(**x), newest.id: lambda x: newest.module.run(**x)}
    import flash_qla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    impls.update(FlashQLA=lambda x: flash_qla.chunk_gated_delta_rule(**x), FLA=lambda x: fla_gdn(**x))
    return impls


def kernel_times(fn, x) -> dict[str, tuple[float, int]]:
    """kernel name -> (device us per call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP):
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn(x)
        torch.cuda.synchronize()
    us, launches = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:90]] += e.device_time_total
            launches[e.name[:90]] += 1
    return {k: (v / CALLS, launches[k] // CALLS) for k, v in us.items()}


def main(out: Path, commit: str) -> int:
    if not torch.cuda.is_available():
        print("kernel_split_lab: needs a CUDA GPU")
        return 1
    meta = bench.versions(commit) | {"method": METHOD}
    rows = []
    for p in PROBLEMS:
        x = p.inputs("cuda", seed=0)
        for name, fn in implementations().items():
            times = kernel_times(fn, x)
            total = sum(us for us, _ in times.values())
            print(f"== {p.label} {name}: {total:.1f} us a call")
            for kernel, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[:TOP]:
                print(f"   {us:9.1f}  x{n}  {kernel}")
                rows.append(dict(problem=p.label, impl=name, kernel=kernel, us=round(us, 1), launches=n,
                                 total_us=round(total, 1), **meta))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    sys.exit(main(a.out, a.commit))
