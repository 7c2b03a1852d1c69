"""Lab: decode. FLA's ``fused_recurrent_gated_delta_rule`` and flashqla's, timed in the same run.

Run on the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python profiles/decode_lab.py --out profiles/results/decode.csv [--commit C]
    python profiles/decode_lab.py --stages --out profiles/results/decode_stages.csv

``--stages`` times the decode stages instead of the library, each row a stage's ``run`` with a new
final state: ``fused_recurrent.s01``, ``fused_recurrent.s02`` at its default width (BV = 8 value
columns a CTA) and at BV = 16 (s01's width), beside FLA in the same run.

Problems: N in {1, 8, 64, 256} sequences of T in {1, 4} tokens each (a batch, B = N), heads
(H, HV) = (16, 32) and (16, 64) (Qwen3.5 35B/9B/4B and 397B/122B at TP1), K = V = 128, bf16 q, k, v.
Two calls, each as its caller makes it:

    plain   g (log decay) and beta (after its sigmoid) in fp32, q and k normalized by the caller,
            states [N, HV, K, V] fp32 in and out
    layer   FLA 0.6.0's GatedDeltaNet at decode: the raw gate a and beta logits b in bf16, A_log and
            dt_bias fp32, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
            state_v_first (states [N, HV, V, K])

Rows: FLA (fla-core 0.6.0's Triton kernel, a new final state), flashqla (a new final state) and
flashqla in place (``inplace_final_state``: the final state written over the initial one, as a
serving engine keeps its pool; the same bytes move). Before timing, every flashqla row passes the
decode check against float64 (``flashqla.testing.check_op``) on N = 8, T = 4, and FLA's error on
that problem is recorded (``rel_err``: o against float64, relative L2).

Timing: ``flashqla.bench.time_row`` (an untimed call per input set, CUDA-graph capture of one call per
set, the median over replays timed with CUDA events; input sets rotate so that together they
exceed twice the L2 cache), and ``ms_eager``: the same calls without a graph (median of 20 rounds,
CUDA events around one round over the sets), which adds the host's launch cost where it exceeds
the GPU's time.

Napkin math per row: bytes = what must cross HBM once (the state read and written, N HV K V x 4 B
each way; q, k, v read and o written; g, beta, A_log, dt_bias read), FLOPs = 7 K V a token and value
head (decay, h^T k, the rank-1 update, h^T q), GB/s and its percentage of the copy roof measured in
the same run (a 1 GiB copy), and ``x_floor`` = ms / (bytes / copy roof).
"""

import argparse
import csv
import functools
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flashqla import reference
from flashqla.bench import roofs, time_row, versions
from flashqla.recurrent import fused_recurrent_gated_delta_rule
from flashqla.stages import load
from flashqla.testing import Problem, cast_floats, check_op, rel_l2, run_on_threads

HEADS = ((16, 32), (16, 64))
BATCHES = (1, 8, 64, 256)
TOKENS = (1, 4)
CALLS = ("plain", "layer")
LAYER_OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, state_v_first=True)
FLA, OURS, OURS_IN_PLACE = "FLA fused_recurrent", "flashqla", "flashqla in place"
EAGER_ROUNDS = 20
COLUMNS = ("problem", "call", "impl", "N", "T", "H", "HV", "ms", "ms_eager", "vs_fla", "gbs",
           "pct_copy_roof", "tflops", "x_floor", "rel_err", "method")


def decode_inputs(H, HV, N, T, call, seed=0) -> dict:
    """Keyword arguments of one decode call (FLA's names), on the GPU."""
    x = Problem(H, HV, (T,) * N, varlen=False).inputs("cuda", seed=seed)
    x.pop("cu_seqlens")
    if call == "layer":
        gen = torch.Generator("cuda").manual_seed(seed + 1)

        def rand(*shape):
            return torch.rand(*shape, generator=gen, device="cuda")

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda")

        x.update(q=randn(N, T, H, 128).bfloat16(), k=randn(N, T, H, 128).bfloat16(),
                 g=randn(N, T, HV).bfloat16(), beta=randn(N, T, HV).bfloat16(),
                 A_log=torch.log(1 + 15 * rand(HV)), dt_bias=torch.log(torch.expm1(1e-3 + 0.099 * rand(HV))),
                 initial_state=x["initial_state"].transpose(-1, -2).contiguous(), **LAYER_OPTIONS)
    return x


def rows(stages: bool = False):
    """(name, fn(inputs)) for every row this machine can run: FLA and the library's calls, or with
    ``stages`` FLA and the decode stages."""
    out = []
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_decode

        out.append((FLA, lambda x: fla_decode(**x)))
    except ImportError:
        print("fla is not installed: no FLA rows", flush=True)
    if stages:
        s01, s02 = load("fused_recurrent", 1), load("fused_recurrent", 2)
        out.append(("fused_recurrent.s01", lambda x: s01.run(**x)))
        out.append(("fused_recurrent.s02", lambda x: s02.run(**x)))
        out.append(("fused_recurrent.s02 BV=16", lambda x: s02.run(**x, BV=16)))
        return out
    out.append((OURS, lambda x: fused_recurrent_gated_delta_rule(**x)))
    out.append((OURS_IN_PLACE, lambda x: fused_recurrent_gated_delta_rule(**x, inplace_final_state=True)))
    return out


def moved_bytes(x: dict) -> int:
    """Bytes that must cross HBM once: every input tensor read, o and the final state written."""
    inputs = sum(t.numel() * t.element_size() for t in x.values() if isinstance(t, torch.Tensor))
    o = x["v"].numel() * 2
    return inputs + o + x["initial_state"].numel() * 4


def flops(N, T, HV) -> int:
    return 7 * 128 * 128 * N * T * HV


def eager_ms(fn, sets) -> float:
    """Median ms of one call without a graph: events around a round of calls over the sets."""
    with torch.no_grad():
        times = []
        for _ in range(EAGER_ROUNDS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for x in sets:
                fn(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / len(sets))
    return statistics.median(times)


def check_rows(cands) -> dict:
    """Each flashqla row must pass the decode check against float64 (raises otherwise); FLA's o error
    is returned per (heads, call) for the CSV."""
    fla_err = {}
    for H, HV in HEADS:
        for call in CALLS:
            x = decode_inputs(H, HV, 8, 4, call, seed=1)
            for name, fn in cands:
                if name == FLA:
                    want = reference.fused_recurrent_gated_delta_rule_ref(**cast_floats(x, torch.float64))[0]
                    with torch.no_grad():
                        fla_err[(H, HV, call)] = rel_l2(fn(dict(x, initial_state=x["initial_state"].clone()))[0], want)
                    continue
                state = x["initial_state"].clone()  # the row may write its state in place
                refs = dict(x, initial_state=x["initial_state"].clone(),
                            inplace_final_state=name == OURS_IN_PLACE)
                check_op("fused_recurrent", lambda **kw: fn({**{n: t for n, t in kw.items() if n !=
                                                                "inplace_final_state"}, "initial_state": state}), refs)
                print(f"checked {name} on ({H}, {HV}) {call}", flush=True)
    return fla_err


def warm_up(cands) -> None:
    """Compile every TileLang variant on threads (nvcc runs outside the GIL), after FLA's Triton
    kernels, one at a time (its JIT is not thread-safe)."""
    tiny = [decode_inputs(H, HV, 1, 1, call) for H, HV in HEADS for call in CALLS]
    for name, fn in cands:
        if name == FLA:
            for x in tiny:
                fn(x)
    run_on_threads([functools.partial(fn, x) for name, fn in cands if name != FLA for x in tiny])
    torch.cuda.synchronize()


def commit_of_checkout() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


def main(out: Path, commit: str, stages: bool = False) -> None:
    cands = rows(stages)
    warm_up(cands)
    print(f"{time.strftime('%X')} compiled; checking", flush=True)
    fla_err = check_rows(cands)
    tflops_roof, gbs_roof = roofs()
    meta = dict(versions(commit), copy_roof_gbs=round(gbs_roof), gemm_roof_tflops=round(tflops_roof))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for H, HV in HEADS:
        for call in CALLS:
            for N in BATCHES:
                for T in TOKENS:
                    first = decode_inputs(H, HV, N, T, call, seed=0)
                    nbytes = moved_bytes(first)
                    sets = [first] + [decode_inputs(H, HV, N, T, call, seed=s)
                                      for s in range(1, max(1, math.ceil(2 * l2 / nbytes)))]
                    label = f"({H}, {HV}) {N}x{T}"
                    base = None
                    for name, fn in cands:
                        ms, method = time_row(fn, sets)
                        ms_eager = eager_ms(fn, sets)
                        base = ms if name == FLA else base
                        results.append(dict(
                            problem=label, call=call, impl=name, N=N, T=T, H=H, HV=HV, ms=round(ms, 5),
                            ms_eager=round(ms_eager, 5), vs_fla="" if base is None else round(base / ms, 2),
                            gbs=round(nbytes / ms / 1e6), pct_copy_roof=round(100 * nbytes / ms / 1e6 / gbs_roof, 1),
                            tflops=round(flops(N, T, HV) / ms / 1e9, 2),
                            x_floor=round(ms / (nbytes / gbs_roof / 1e6), 2),
                            rel_err=f"{fla_err[(H, HV, call)]:.2e}" if name == FLA else "checked",
                            method=method, **meta))
                        r = results[-1]
                        print(f"{label:20} {call:6} {name:18} {r['ms']:>9} ms (eager {r['ms_eager']:>9}) "
                              f"vs FLA {r['vs_fla']:>5}  {r['gbs']:>6} GB/s {r['pct_copy_roof']:>5}% of copy  "
                              f"x_floor {r['x_floor']}", flush=True)
                    del sets, first
                    torch.cuda.empty_cache()
                    write(results, out)


def write(results, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(COLUMNS) + [k for k in results[0] if k not in COLUMNS]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode.csv")
    parser.add_argument("--commit", default=None, help="the commit to record (default: git's HEAD)")
    parser.add_argument("--stages", action="store_true", help="time the decode stages, not the library")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_lab: needs a CUDA GPU")
    main(args.out, args.commit or commit_of_checkout(), args.stages)
