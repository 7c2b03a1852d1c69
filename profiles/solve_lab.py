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

    python3 profiles/solve_lab.py --kernels OUT.csv [--commit SHA]

times the kernels the library's forward runs before and after gate_free_solve.s15 and s16 (phase
B's block levels on mma.sync): s06's solve against s15's at three or four heads a CTA, s14's
cumsum-and-solve kernel against s16's at one or two (``KERNEL_PROBLEMS``). One row per (problem,
heads a CTA): each kernel alone, 20 launches captured in a CUDA graph, the best of five replays per
launch, in us; ``rel_l2``: the new kernel's Ab against the old one's (both tf32 somewhere, s06 not).
``results/solve_kernels.csv`` (one H100, commit 1a05b0c) is what s15's and s16's docstrings quote.
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
              if s.op == "gate_free_solve" and s.number >= FIRST_STAGE and hasattr(s.module, "solve")}
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


# (problem, heads a CTA): s06 -> s15 at three or four, s14 -> s16 at one or two
KERNEL_PROBLEMS = [("(16, 64) 1x8192", 4), ("(16, 64) 8x4096", 4), ("(16, 48) 1x32768", 3), ("(8, 24) 28672+4096", 3),
                   ("(8, 32) 1x8192", 4), ("(2, 8) 8x4096", 4), ("(16, 16) 8x4096", 1), ("(16, 16) 1x8192", 1),
                   ("(16, 32) 8x4096", 2), ("(16, 32) 1x8192", 2), ("(8, 32) 1x2048", 2), ("(8, 24) 1x2048", 1),
                   ("(16, 16) 1x2048", 1)]
GRAPH_LAUNCHES = 20


def graph_us(fn) -> float:
    """``fn()`` alone: GRAPH_LAUNCHES launches in one CUDA graph, the best of five replays, us a launch."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_LAUNCHES):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / GRAPH_LAUNCHES)
    return best


def measure_kernels(out: Path, commit: str) -> int:
    import torch

    from flashqla import bench, stages
    from flashqla.varlen import num_chunk_rows, seq_bounds

    s06, s14, s15, s16 = (stages.load("gate_free_solve", n) for n in (6, 14, 15, 16))
    by_label = {bench.short_label(p.label): p for p in bench.PROBLEMS}
    rows = []
    for label, R in KERNEL_PROBLEMS:
        p = by_label[label]
        x = p.inputs("cuda", seed=0)
        B, T, H, K = x["k"].shape
        HV, device = p.HV, "cuda"
        k = x["k"].contiguous().view(B * T, H, K)
        beta, g = (x[n].float().contiguous().view(B * T, HV) for n in ("beta", "g"))
        seqs = seq_bounds(x["cu_seqlens"], B, T, device)
        num_rows = num_chunk_rows(x["cu_seqlens"], B, T, 64)
        cumsum = s14.PROLOGUE.CUMSUM._compiled(HV)  # chunk_local_cumsum.s03: g_cum and the table
        g_cum = torch.empty(B * T, HV, device=device)
        table = torch.empty(num_rows, 2, dtype=torch.int32, device=device)
        first_chunk = torch.empty(seqs.shape[0], dtype=torch.int32, device=device)
        gated = torch.empty(num_rows, HV, dtype=torch.int32, device=device)
        old, new = (s06, s15) if R > 2 else (s14, s16)
        abs_, times = [], []
        for stage in (old, new):
            ab = torch.empty(B * T, HV, 64, dtype=torch.bfloat16, device=device)
            kernel = stage._compiled(H, HV, R)
            if R > 2:  # the cumsum and the table once, then the solve alone
                cumsum(g, seqs, g_cum, table, first_chunk)
                times.append(graph_us(lambda: kernel(k, beta, g_cum, table, ab, gated)))
            else:      # the table, the cumsum and the solve in one kernel
                times.append(graph_us(lambda: kernel(k, beta, g, seqs, g_cum, table, first_chunk, ab, gated)))
            abs_.append(ab.float())
        rows.append(dict(problem=p.label, heads_per_cta=R, before=old.__name__.split(".")[-1],
                         after=new.__name__.split(".")[-1], before_us=round(times[0], 1),
                         after_us=round(times[1], 1),
                         rel_l2=f"{((abs_[1] - abs_[0]).norm() / abs_[0].norm()).item():.1e}",
                         **bench.versions(commit), method=f"each kernel alone, {GRAPH_LAUNCHES} launches in a "
                         "CUDA graph, best of 5 replays (CUDA events)"))
        print(rows[-1], flush=True)
        with open(out, "w", newline="") as f:
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
    ap.add_argument("--kernels", action="store_true", help="the library's solve kernels before and after s15/s16")
    a = ap.parse_args()
    if a.report:
        print(report(a.csv))
        sys.exit(0)
    if a.kernels:
        sys.exit(measure_kernels(a.csv, a.commit))
    sys.exit(measure(a.csv, {tuple(int(n) for n in h.split(",")) for h in a.heads}, a.commit))
