"""Lab: AutoCP's segment length, gdn_fwd.s18, s20 or s21 forced to each L beside its unsplit launch,
the stage before it and FlashQLA, on few heads and long sequences.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/split_lab.py OUT.csv [--stage 18|20|21|23|24|29|33|44] [--heads H,HV ...]
        [--problems LABEL ...] [--ls L ...] [--commit SHA]

For each problem of PROBLEMS, rows ``impl, L, ms``: the stage (``gdn_fwd.s18`` by default) with
``cp=L`` for each L of LS whose segments are at most a third of the longest sequence (L = 0:
``cp=False``, the unsplit launch) and for the rules' two candidates, L0 (the shortest L whose
segments fill two phase-3 CTAs an SM, ``gdn_fwd.s18.segment_chunks``) and 2 L0, where they leave
two segments or more, and each L of ``--ls`` that leaves two segments or more, ``gdn_fwd.sNN auto`` (the rule), the stage before it
(PREVIOUS, its own rule) and ``FlashQLA``; ``flashqla.bench.time_row``
(CUDA-graph replay over input sets that exceed twice the L2 cache, median). ``rel_err``: the
split's o and final state against the unsplit launch's (relative L2, the larger), which the
warm-up's bound keeps at bf16 rounding. Plus ``flashqla.bench.versions``' provenance columns.
``profiles/results/autocp_split.csv`` holds a run of s18 (4 x H100, commit c585a80), one of s20,
one of s21 (three calls), one of s23 (one H100, f36f275) and one of s24 (one H100, 6879a4c, and
c5feab3 for the five problems s23's rule was the first to split) and one of s33 on (8, 24) 1x32768 and
28672+4096 with ``--ls 93 103 112`` (one H100, d7fcab5); ``tests/test_autocp.py`` checks
the rules of s18, s20, s22 (which runs s21's kernels), s23 and s24 against them. s23's and s24's
``auto`` rows are not kept: each ran the rule before the refit that its own sweep led to (s22's
costs, s23's). ``--report IN.csv`` prints the table.
"""

import argparse
import csv
import sys
from pathlib import Path

from flashqla.testing import Problem

PROBLEMS = [Problem(H, HV, lengths) for H, HV in ((2, 8), (4, 16), (16, 16))
            for lengths in ((32768,), (28672, 4096), (8192,))] + [
    Problem(8, 32, (32768,)), Problem(16, 32, (32768,)), Problem(8, 24, (32768,)), Problem(2, 8, (2048,)),
    Problem(8, 24, (28672, 4096)),
    # where s23's rule splits and no earlier rule did
    Problem(8, 32, (8192,)), Problem(16, 32, (8192,)), Problem(8, 24, (8192,)),
    Problem(8, 32, (28672, 4096)), Problem(16, 32, (28672, 4096)),
    # no rule splits them; the unsplit launch leaves SMs idle (96 CTAs at BV 64 on (16, 48))
    Problem(16, 48, (32768,)), Problem(16, 48, (8192,)), Problem(16, 64, (32768,))]
LS = (0, 8, 16, 24, 32, 48, 64, 96)
PREVIOUS = {18: 17, 20: 18, 21: 20, 23: 22, 24: 23, 29: 28, 33: 29, 44: 43}  # the stage whose split a stage's sweep is compared with


def measure(out: Path, heads, commit: str, stage: int, labels=(), extra_ls=()) -> int:
    import torch

    from flashqla import autocp, bench, stages
    from flashqla.testing import rel_l2

    import flash_qla

    mod, prev = stages.load("gdn_fwd", stage), stages.load("gdn_fwd", PREVIOUS[stage])
    s18, sms = stages.load("gdn_fwd", 18), autocp.num_sms(torch.device("cuda"))
    name = f"gdn_fwd.s{stage}"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    meta = dict(bench.versions(commit), method="CUDA graph replay, median (bench.time_row)")
    rows = []
    for p in PROBLEMS:
        if heads and (p.H, p.HV) not in heads or labels and bench.short_label(p.label) not in labels:
            continue
        sets = bench.input_sets(p, l2)
        x = sets[0]
        off = mod.forward(**x, cp=False)
        seq_chunks = [-(-n // 64) for n in p.lengths]
        L0 = s18.segment_chunks(seq_chunks, p.HV, sms, 0.0, True)
        Ls = {L for L in LS if 3 * 64 * L <= max(p.lengths)}
        Ls |= {L for L in (L0, 2 * L0, *extra_ls) if -(-max(seq_chunks) // L) >= 2}
        impls = [(name, L, lambda y, L=L: mod.forward(**y, cp=L if L else False)) for L in sorted(Ls)]
        impls += [(f"{name} auto", "", lambda y: mod.run(**y)),
                  (f"gdn_fwd.s{PREVIOUS[stage]}", "", lambda y: prev.run(**y)),
                  ("FlashQLA", "", lambda y: flash_qla.chunk_gated_delta_rule(**y))]
        for impl, L, fn in impls:
            got = fn(x)
            err = max(rel_l2(got[0], off[0]), rel_l2(got[1], off[1]))
            rows.append(dict(problem=p.label, impl=impl, L=L, ms=round(bench.time_row(fn, sets)[0], 4),
                             rel_err=f"{err:.1e}", **meta))
            print(rows[-1], flush=True)
        with open(out, "w", newline="") as f:  # after every problem: a cut-short run keeps its rows
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report(path: Path, stage: int) -> str:
    """Per problem: ms of the stage at each L (0: unsplit), its rule's choice, the stage before it
    and FlashQLA."""
    from flashqla.bench import short_label, split_sweep

    name = f"gdn_fwd.s{stage}"
    sweep = split_sweep(name, path)
    Ls = sorted({int(L) for t in sweep.values() for impl, L in t if impl == name and L != ""})
    extra = [f"{name} auto", f"gdn_fwd.s{PREVIOUS[stage]}", "FlashQLA"]
    lines = [f"{'problem':20s}" + "".join(f"{'L ' + str(L) if L else 'unsplit':>9s}" for L in Ls)
             + "".join(f"{e.replace('gdn_fwd.', ''):>10s}" for e in extra)]
    for label, got in sweep.items():
        cell = lambda key, width: f"{got[key]:>{width}}" if key in got else f"{'-':>{width}s}"
        lines.append(f"{short_label(label):20s}" + "".join(cell((name, str(L)), 9) for L in Ls)
                     + "".join(cell((e, ""), 10) for e in extra))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--heads", nargs="*", default=[], help="only these, e.g. 16,16 2,8")
    ap.add_argument("--problems", nargs="*", default=[], help='only these, e.g. "(8, 32) 1x8192"')
    ap.add_argument("--ls", nargs="*", type=int, default=[], help="segment lengths to time besides LS")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--stage", type=int, default=18, choices=sorted(PREVIOUS))
    ap.add_argument("--report", action="store_true", help="print the table of an existing CSV")
    a = ap.parse_args()
    if a.report:
        print(report(a.csv, a.stage))
        sys.exit(0)
    sys.exit(measure(a.csv, {tuple(int(n) for n in h.split(",")) for h in a.heads}, a.commit, a.stage,
                     set(a.problems), a.ls))
