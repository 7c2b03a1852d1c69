"""Lab: the fused forward kernel at each width BV (value columns of the state a CTA owns), alone and
in its pipeline, beside FlashQLA's and FLA's whole forward.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/kernel_width_lab.py OUT.csv [--heads H,HV ...] [--commit SHA]

For each problem of ``flashqla.bench.PROBLEMS`` (the chosen head configurations), one row:

    problem             the problem's label
    FLA, FlashQLA, API  the whole forward, ms (``flashqla.bench.time_row``: CUDA-graph replay of one
                        call per input set, median; the sets together exceed twice the L2 cache)
    s14                 gdn_fwd.s14's whole forward, its width by its ``block_v``
    s12 f32, s12 f64    gdn_fwd.s12's fused kernel alone at BV = 32 and 64, ms (graph replay of
                        one call on input set 0, median of 20): the chunk_local_cumsum and
                        gate_free_solve.s02 outputs it reads are made once, outside the timing
    s14 f32, f64, f128  gdn_fwd.s14's fused kernel alone at BV = 32, 64 and 128, the same way
    s16 f32, f64, f128  gdn_fwd.s16's (O by TMA store), the same way
    solve               gate_free_solve.s02 alone, the same way
    flops               ``flashqla.bench.useful_flops``

plus the provenance columns of ``flashqla.bench.versions`` and ``method``. On any machine,

    python3 profiles/kernel_width_lab.py --report IN.csv

prints, per problem, the fastest width of each kernel, s14 at 128 against s12's fastest and s16
against s14 at 128.

``profiles/results/kernel_width.csv`` holds one run on 4 x H100 (one process a GPU, each taking
its own layouts), all 40 problems, at commit 51893cc (the API column there is gdn_fwd.s15's
pipeline, the library's forward on that branch; s17's steps come from this run).
"""

import argparse
import csv
import sys
from pathlib import Path

FUSED = (("s12", 12, (32, 64)), ("s14", 14, (32, 64, 128)), ("s16", 16, (32, 64, 128)))


def measure(out: Path, heads, commit: str) -> int:
    import flash_qla
    import torch

    from flashqla import bench, stages
    from flashqla.api import chunk_gated_delta_rule
    from flashqla.varlen import chunk_table, seq_bounds

    fla, s14 = stages.load("gdn_fwd", 0), stages.load("gdn_fwd", 14)
    cumsum, solve = stages.load("chunk_local_cumsum", 1), stages.load("gate_free_solve", 2)
    whole = [("FLA", lambda x: fla.run(**x)), ("FlashQLA", lambda x: flash_qla.chunk_gated_delta_rule(**x)),
             ("API", lambda x: chunk_gated_delta_rule(**x)), ("s14", lambda x: s14.run(**x))]
    alone = lambda fn: round(bench._graph_or_events(lambda _: fn(), [None], 20)[0], 4)  # noqa: E731
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for p in bench.PROBLEMS:
        if heads and (p.H, p.HV) not in heads:
            continue
        sets = bench.input_sets(p, l2)
        row = {"problem": p.label}
        row.update((name, round(bench.time_row(fn, sets)[0], 4)) for name, fn in whole)
        x = sets[0]
        B, T, H, K = x["q"].shape
        HV, V = x["v"].shape[2:]
        q, k, v = (x[n].contiguous() for n in "qkv")
        beta, cu = x["beta"].float().contiguous(), x["cu_seqlens"]
        g_cum = cumsum.run(x["g"].float().contiguous(), cu, 64).contiguous()
        ab, gated = solve.solve(k, beta, g_cum, cu)
        bounds = seq_bounds(cu, B, T, q.device)
        _, first_chunk = chunk_table(cu, B, T, 64, q.device)
        o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=q.device)
        ht = torch.empty(bounds.shape[0] - 1, HV, K, V, dtype=torch.float32, device=q.device)
        args = (q.view(B * T, H, K), k.view(B * T, H, K), v.view(B * T, HV, V), ab.view(B * T, HV, 64),
                g_cum.view(B * T, HV), gated, x["initial_state"].float().contiguous(), bounds,
                first_chunk, K ** -0.5, o, ht)
        for name, number, widths in FUSED:
            stage = stages.load("gdn_fwd", number)
            for bv in widths:
                kernel = stage._compiled(H, HV, K, V, bv)
                row[f"{name} f{bv}"] = alone(lambda: kernel(*args))
        row["solve"] = alone(lambda: solve.solve(k, beta, g_cum, cu))
        row["flops"] = bench.useful_flops(p)
        row.update(bench.versions(commit), method="CUDA graph replay, median")
        rows.append(row)
        print(row, flush=True)
        with open(out, "w", newline="") as f:  # after every problem: a cut-short run keeps its rows
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report(path: Path) -> str:
    """Per problem: each kernel's fastest width, s14 at 128 against s12's fastest, s16 against s14
    at 128."""
    from flashqla.bench import short_label

    lines = [f"{'problem':24s}" + "".join(f"{name + ' best':>16s}" for name, _, _ in FUSED)
             + f"{'s14 f128 / s12 best':>21s}{'s16 f128 / s14 f128':>21s}"]
    for row in csv.DictReader(open(path)):
        best = {}
        for name, _, widths in FUSED:
            bv = min(widths, key=lambda w: float(row[f"{name} f{w}"]))
            best[name] = f"{float(row[f'{name} f{bv}']):10.4f} @{bv:<4d}"
        s12_best = min(float(row[f"s12 f{w}"]) for w in FUSED[0][2])
        lines.append(f"{short_label(row['problem']):24s}" + "".join(best.values())
                     + f"{float(row['s14 f128']) / s12_best:21.2f}"
                     + f"{float(row['s16 f128']) / float(row['s14 f128']):21.2f}")
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
