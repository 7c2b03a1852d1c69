"""Lab: the gate-free solve alone, every gate_free_solve stage from s02 on beside FlashQLA's
kkt_solve, on the same inputs in the same process.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/solve_lab.py OUT.csv [--heads H,HV ...] [--commit SHA]

For each problem of ``flashqla.bench.PROBLEMS`` with one sequence of 32768 tokens or 8 x 4096
(the chosen head configurations), one row:

    problem             the problem's label
    s02, s04, ...       gate_free_solve.sNN's ``solve`` alone, ms (``flashqla.bench.time_row``:
                        CUDA-graph replay of one call per input set, median; the sets together
                        exceed twice the L2 cache; g_cum made once per set, outside the timing)
    FlashQLA            flash_qla's hopper ``kkt_solve`` (k, beta, cu_seqlens) the same way: the
                        same matrix with no gate, its output Ab in bf16 as ours
    bytes               what a solve must move at least: K and beta in, Ab out
    gbs, pct_copy_roof  the fastest of our stages' GB/s at ``bytes``, and its share of the copy
                        roof measured in the same process (``flashqla.bench.roofs``)
    equal_s02           whether every later stage gave s02's Ab and flags bit for bit

plus the provenance columns of ``flashqla.bench.versions`` and ``method``. On any machine,

    python3 profiles/solve_lab.py --report IN.csv

prints, per problem, each stage's time over s02's and FlashQLA's over the fastest stage's.
"""

import argparse
import csv
import sys
from pathlib import Path

FIRST_STAGE = 2  # s01 solves row by row (4x s02's instructions): not a candidate any more


def measure(out: Path, heads, commit: str) -> int:
    import torch
    from flash_qla.ops.gated_delta_rule.chunk.hopper.kkt_solve import kkt_solve

    from flashqla import bench, stages

    cumsum = stages.load("chunk_local_cumsum", 1)
    solves = {f"s{s.number:02d}": s.module for s in stages.discover()
              if s.op == "gate_free_solve" and s.number >= FIRST_STAGE}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    _, gbs_roof = bench.roofs()
    rows = []
    for p in bench.PROBLEMS:
        label = bench.short_label(p.label)
        if (heads and (p.H, p.HV) not in heads) or not label.endswith(("1x32768", "8x4096")):
            continue
        sets = [dict(x, g_cum=cumsum.run(x["g"].float().contiguous(), x["cu_seqlens"], 64).contiguous(),
                     beta=x["beta"].float().contiguous()) for x in bench.input_sets(p, l2)]
        row = {"problem": p.label}
        for name, mod in solves.items():
            row[name] = round(bench.time_row(
                lambda x, m=mod: m.solve(x["k"], x["beta"], x["g_cum"], x["cu_seqlens"]), sets)[0], 4)
        row["FlashQLA"] = round(bench.time_row(
            lambda x: kkt_solve(x["k"], x["beta"], 64, x["cu_seqlens"]), sets)[0], 4)
        x = sets[0]
        want = solves["s02"].solve(x["k"], x["beta"], x["g_cum"], x["cu_seqlens"])
        got = [m.solve(x["k"], x["beta"], x["g_cum"], x["cu_seqlens"]) for m in solves.values()]
        tokens = x["k"].shape[1]
        nbytes = tokens * (p.H * 128 * 2 + p.HV * 4 + p.HV * 64 * 2)
        best = min(row[name] for name in solves)
        row.update(bytes=nbytes, gbs=round(nbytes / best / 1e6), pct_copy_roof=round(
            100 * nbytes / best / 1e6 / gbs_roof, 1),
            equal_s02=all(torch.equal(a, want[0]) and torch.equal(f, want[1]) for a, f in got))
        row.update(bench.versions(commit), copy_roof_gbs=round(gbs_roof),
                   method="CUDA graph replay, median (bench.time_row)")
        rows.append(row)
        print(row, flush=True)
        with open(out, "w", newline="") as f:  # after every problem: a cut-short run keeps its rows
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report(path: Path) -> str:
    """Per problem: each stage over s02, FlashQLA's kkt_solve over our fastest stage."""
    from flashqla.bench import short_label

    rows = list(csv.DictReader(open(path)))
    names = [k for k in rows[0] if k.startswith("s") and k[1:].isdigit()]
    lines = [f"{'problem':20s}" + "".join(f"{n + ' / s02':>11s}" for n in names[1:])
             + f"{'FlashQLA / ours':>17s}{'GB/s':>7s}{'% roof':>8s}"]
    for row in rows:
        ms = {n: float(row[n]) for n in names}
        lines.append(f"{short_label(row['problem']):20s}"
                     + "".join(f"{ms[n] / ms['s02']:11.2f}" for n in names[1:])
                     + f"{float(row['FlashQLA']) / min(ms.values()):17.2f}{row['gbs']:>7s}"
                     + f"{row['pct_copy_roof']:>8s}")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--heads", nargs="*", default=[], help="only these, e.g. 16,64 2,8")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--report", action="store_true", help="print the table of an existing CSV")
    a = ap.parse_args()
    if a.report:
        print(report(a.csv))
        sys.exit(0)
    sys.exit(measure(a.csv, {tuple(int(n) for n in h.split(",")) for h in a.heads}, a.commit))
