"""Lab: AutoCP's segment length, gdn_fwd.s18 forced to each L beside its unsplit launch, s17 and
FlashQLA, on few heads and long sequences.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/split_lab.py OUT.csv [--heads H,HV ...] [--commit SHA]

For each problem of PROBLEMS, rows ``impl, L, ms``: ``gdn_fwd.s18`` with ``cp=L`` for each L of
LS whose segments are at most a third of the longest sequence (L = 0: ``cp=False``, the unsplit
launch), ``gdn_fwd.s18 auto`` (the rule), ``gdn_fwd.s17`` and ``FlashQLA``; ``flashqla.bench.time_row``
(CUDA-graph replay over input sets that exceed twice the L2 cache, median). ``rel_err``: the
split's o and final state against the unsplit launch's (relative L2, the larger), which the
warm-up's bound keeps at bf16 rounding. Plus ``flashqla.bench.versions``' provenance columns.
``profiles/results/autocp_split.csv`` holds one run (4 x H100, commit c585a80);
``tests/test_autocp.py`` checks s18's rule against it. ``--report IN.csv`` prints the table.
"""

import argparse
import csv
import sys
from pathlib import Path

from flashqla.testing import Problem

PROBLEMS = [Problem(H, HV, lengths) for H, HV in ((2, 8), (4, 16), (16, 16))
            for lengths in ((32768,), (28672, 4096), (8192,))] + [
    Problem(8, 32, (32768,)), Problem(16, 32, (32768,)), Problem(8, 24, (32768,)), Problem(2, 8, (2048,))]
LS = (0, 8, 16, 24, 32, 48, 64, 96)


def measure(out: Path, heads, commit: str) -> int:
    import torch

    from flashqla import bench, stages
    from flashqla.testing import rel_l2

    import flash_qla

    s17, s18 = stages.load("gdn_fwd", 17), stages.load("gdn_fwd", 18)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    meta = dict(bench.versions(commit), method="CUDA graph replay, median (bench.time_row)")
    rows = []
    for p in PROBLEMS:
        if heads and (p.H, p.HV) not in heads:
            continue
        sets = bench.input_sets(p, l2)
        x = sets[0]
        off = s18.forward(**x, cp=False)
        impls = [("gdn_fwd.s18", L, lambda y, L=L: s18.forward(**y, cp=L if L else False))
                 for L in LS if 3 * 64 * L <= max(p.lengths)]
        impls += [("gdn_fwd.s18 auto", "", lambda y: s18.run(**y)), ("gdn_fwd.s17", "", lambda y: s17.run(**y)),
                  ("FlashQLA", "", lambda y: flash_qla.chunk_gated_delta_rule(**y))]
        for name, L, fn in impls:
            got = fn(x)
            err = max(rel_l2(got[0], off[0]), rel_l2(got[1], off[1]))
            rows.append(dict(problem=p.label, impl=name, L=L, ms=round(bench.time_row(fn, sets)[0], 4),
                             rel_err=f"{err:.1e}", **meta))
            print(rows[-1], flush=True)
        with open(out, "w", newline="") as f:  # after every problem: a cut-short run keeps its rows
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report(path: Path) -> str:
    """Per problem: ms of s18 at each L (0: unsplit), its rule's choice, s17 and FlashQLA."""
    from flashqla.bench import short_label

    rows = list(csv.DictReader(open(path)))
    Ls = sorted({int(r["L"]) for r in rows if r["L"] != ""})
    extra = ["gdn_fwd.s18 auto", "gdn_fwd.s17", "FlashQLA"]
    lines = [f"{'problem':20s}" + "".join(f"{'L ' + str(L) if L else 'unsplit':>9s}" for L in Ls)
             + "".join(f"{e.replace('gdn_fwd.', ''):>10s}" for e in extra)]
    for label in dict.fromkeys(r["problem"] for r in rows):
        got = {(r["impl"], r["L"]): r["ms"] for r in rows if r["problem"] == label}
        lines.append(f"{short_label(label):20s}"
                     + "".join(f"{got.get(('gdn_fwd.s18', str(L)), '-'):>9s}" for L in Ls)
                     + "".join(f"{got.get((e, ''), '-'):>10s}" for e in extra))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--heads", nargs="*", default=[], help="only these, e.g. 16,16 2,8")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--report", action="store_true", help="print the table of an existing CSV")
    a = ap.parse_args()
    if a.report:
        print(report(a.csv))
        sys.exit(0)
    sys.exit(measure(a.csv, {tuple(int(n) for n in h.split(",")) for h in a.heads}, a.commit))
