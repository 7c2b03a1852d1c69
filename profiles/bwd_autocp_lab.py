"""Lab: backward AutoCP's segment length, gdn_bwd.s03 (backward only) forced to each L beside s02 and
s03's rule, on few heads and long sequences.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/bwd_autocp_lab.py OUT.csv [--heads H,HV ...] [--problems LABEL ...]
        [--ls L ...] [--commit SHA]

For each problem of PROBLEMS, rows ``impl, L, ms``: ``gdn_bwd.s02`` (the unsplit backward),
``gdn_bwd.s03 auto`` (its rule's L, 0 for no split) and ``gdn_bwd.s03`` with ``cp=L`` for each L of
LS (or ``--ls``) that leaves two segments or more; each is the backward alone (``run`` on the
inputs with do and dht, ``flashqla.bench.time_row``: CUDA-graph replay over input sets that exceed
twice the L2 cache, median), checked once against float64 (``check_op`` on a small varlen problem
of the same heads, each L) before timing. Napkin math per row: the backward's useful FLOPs (a
training step's minus the forward's, ``bench.train_flops`` - ``bench.useful_flops``) and bytes
(what it must move: the forward's again, ``bench.useful_bytes``), as TFLOP/s, GB/s and their
percentage of the roofs measured in the same run (``bench.roofs``). The training step with FLA and
FlashQLA in the same run is ``python -m flashqla bench --mode gdn_train`` (s03 is a row there).
``--report IN.csv`` prints the table.
"""

import argparse
import csv
import sys
from pathlib import Path

from flashqla.testing import Problem

PROBLEMS = [Problem(H, HV, lengths) for H, HV in ((2, 8), (4, 16), (16, 16))
            for lengths in ((8192,), (32768,))] + [
    Problem(8, 24, (32768,)), Problem(8, 32, (32768,)),      # the walk fills most SMs: the rule does not split
    Problem(2, 8, (4096,) * 8)]
LS = (8, 16, 24, 32, 48, 64, 96, 128)
BWD_ARGS = ("q", "k", "v", "g", "beta", "do", "dht", "scale", "initial_state", "cu_seqlens")
COLUMNS = ("problem", "impl", "L", "ms", "vs_s02", "tflops", "pct_gemm_roof", "gbs", "pct_copy_roof")


def measure(out: Path, heads, commit: str, labels=(), ls=LS) -> int:
    import torch

    from flashqla import bench, stages
    from flashqla.testing import check_op, op_inputs

    s02, s03 = stages.load("gdn_bwd", 2), stages.load("gdn_bwd", 3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    problems = [p for p in PROBLEMS if (not heads or (p.H, p.HV) in heads)
                and (not labels or bench.short_label(p.label) in labels)]
    tflops_roof, gbs_roof = bench.roofs()
    meta = dict(bench.versions(commit), method="CUDA graph replay, median (bench.time_row)",
                gemm_roof_tflops=round(tflops_roof), copy_roof_gbs=round(gbs_roof))
    rows = []
    for p in problems:
        chunks = [-(-n // s03.CHUNK_SIZE) for n in p.lengths]
        longest = max(chunks)
        variants = [("gdn_bwd.s02", 0, s02.run), ("gdn_bwd.s03 auto", s03.segment_chunks(chunks, p.HV, sms),
                                                  s03.run)]
        variants += [("gdn_bwd.s03", L, lambda L=L, **x: s03.run(**x, cp=L)) for L in ls if -(-longest // L) >= 2]
        small = op_inputs("gdn_bwd", Problem(p.H, p.HV, bench.CHECK_LENGTHS).inputs("cuda", seed=1))
        sets = bench.input_sets(p, l2, training=True)
        flops = bench.train_flops(p) - bench.useful_flops(p)
        nbytes = bench.useful_bytes(p)
        base = None
        for impl, L, fn in variants:
            check_op("gdn_bwd", fn, small)
            ms, _ = bench.time_row(lambda x, fn=fn: fn(**{n: x[n] for n in BWD_ARGS}), sets, grad=False)
            base = ms if base is None else base
            rows.append(dict(problem=p.label, impl=impl, L=L, ms=round(ms, 4), vs_s02=round(base / ms, 2),
                             tflops=round(flops / ms / 1e9, 1),
                             pct_gemm_roof=round(100 * flops / ms / 1e9 / tflops_roof, 1),
                             gbs=round(nbytes / ms / 1e6), pct_copy_roof=round(100 * nbytes / ms / 1e6 / gbs_roof, 1),
                             **meta))
            print(f"{p.label:24s} {impl:18s} L={L:<4d} {ms:8.4f} ms  {base / ms:5.2f}x s02", flush=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
    return 0


def report(path: Path) -> None:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    print(f"{'problem':24s} {'impl':18s} {'L':>4s} {'ms':>8s} {'vs s02':>7s} {'TFLOP/s':>8s} {'GB/s':>6s}")
    for r in rows:
        print(f"{r['problem']:24s} {r['impl']:18s} {r['L']:>4s} {r['ms']:>8s} {r['vs_s02']:>7s} "
              f"{r['tflops']:>8s} {r['gbs']:>6s}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--heads", nargs="+", default=(), metavar="H,HV")
    parser.add_argument("--problems", nargs="+", default=(), metavar="LABEL")
    parser.add_argument("--ls", nargs="+", type=int, default=LS, metavar="L")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    if args.out is None:
        parser.error("give OUT.csv (or --report IN.csv)")
    heads = [tuple(int(n) for n in h.split(",")) for h in args.heads]
    return measure(args.out, heads, args.commit, args.problems, args.ls)


if __name__ == "__main__":
    sys.exit(main())
