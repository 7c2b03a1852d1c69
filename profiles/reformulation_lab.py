"""Lab: gdn_fwd.s04 (the reformulation) against s03, the promoted forward and FLA, on the GPU.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/reformulation_lab.py errors    # rel. L2 errors vs float64, s03 and s04
    python3 profiles/reformulation_lab.py timing    # the table (CUDA events, median of 20)

An optional second argument, a time limit in seconds, dumps the stacks 10 s before it.

``errors`` runs flashqla.testing.check_op's measurement (no assertion) for gdn_fwd.s03 and s04 on
the adversarial inputs of flashqla.testing (as tests/test_reformulation.py) and on a public problem. ``timing`` times,
per problem, each entry once per repeat after 3 warm-up calls (flashqla.timing.median_ms, 20
repeats): FLA's chunk_gated_delta_rule (gdn_fwd.s00, FLA_FLASH_QLA=0), gdn_fwd.s03's run, the
promoted forward (flashqla.fwd; chunk_fwd_intra.s01 + s03's fused kernel when these numbers were taken), gdn_fwd.s04's run, the
two fused kernels alone (inputs precomputed), and the two preparations alone: chunk_fwd_intra.s01
(w, u) and gate_free_solve.s01 (Ab), the latter also with one value head per CTA.
"""

import concurrent.futures
import functools
import sys
import time

import torch

from flashqla import fwd, stages
from flashqla.testing import (ADVERSARIAL, OPS, Problem, adversarial_inputs, cast_floats, rel_l2,
                              warm_up)
from flashqla.timing import median_ms

PROBLEMS = (Problem(16, 64, (32768,)), Problem(2, 8, (32768,)), Problem(16, 32, (4096,) * 8))


def errors():
    ref_fn = OPS["gdn_fwd"][0]
    cases = [(kind, adversarial_inputs(kind, seed=1)) for kind in ADVERSARIAL]
    cases.append(("public (4, 16) varlen", Problem(4, 16, (200, 777, 64, 1, 130)).inputs("cuda", 1)))
    print(f"{'inputs':24s} {'output':12s} {'bf16 ref':>9s} {'s03':>9s} {'s04':>9s}")
    for label, x in cases:
        want = ref_fn(**cast_floats(x, torch.float64))
        bf16 = ref_fn(**cast_floats(x, torch.bfloat16))
        got = [stages.load("gdn_fwd", n).run(**x) for n in (3, 4)]
        for i, name in enumerate(("o", "final_state")):
            print(f"{label:24s} {name:12s} {rel_l2(bf16[i], want[i]):9.2e} "
                  f"{rel_l2(got[0][i], want[i]):9.2e} {rel_l2(got[1][i], want[i]):9.2e}")


def _table(title, rows):
    print(f"\n{title}: ms, {torch.cuda.get_device_name()}, CUDA events, median of 20 after 3 warm-up calls")
    names = list(rows[0][1])
    print(f"{'(H, HV) tokens':24s}" + "".join(f"{n:>12s}" for n in names))
    for label, t in rows:
        print(f"{label:24s}" + "".join(f"{t[n]:12.3f}" for n in names), flush=True)


def timing():
    """Two phases, each printing its table: our kernels first, then FLA and s03's run, whose
    warm-up (Triton autotuning, s03's three preparation kernels) takes the longest."""
    s00, s03, s04 = (stages.load("gdn_fwd", n) for n in (0, 3, 4))
    intra, solve, cumsum = (stages.load(op, 1) for op in ("chunk_fwd_intra", "gate_free_solve",
                                                          "chunk_local_cumsum"))
    import tilelang  # noqa: F401  first import here: importing it on several threads at once fails

    heads = sorted({(p.H, p.HV) for p in PROBLEMS})
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:.0f} s] {msg}", flush=True)

    def warm(ids, extra=()):
        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # compiles while warm_up runs
            jobs = [pool.submit(fn, *args) for fn, args in extra]
            warm_up([s for s in stages.discover() if s.id in ids], heads=heads)
            for job in jobs:
                job.result()
        log(f"warmed up {ids}")

    warm(("gdn_fwd.s04", "chunk_fwd_intra.s01"),
         [(s03._compiled, (H, HV, 128, 128)) for H, HV in heads]
         + [(solve._compiled, (H, HV, 1)) for H, HV in heads])
    problems = []  # per problem: the forward's inputs and every precomputed intermediate
    for p in PROBLEMS:
        d = p.inputs("cuda")
        d["g_cum"] = cumsum.run(d["g"], d["cu_seqlens"])
        d["w"], d["u"] = intra.run(d["k"], d["v"], d["g_cum"], d["beta"], d["cu_seqlens"])
        d["ab"], d["gated"] = solve.solve(d["k"], d["beta"], d["g_cum"], d["cu_seqlens"])
        problems.append((p, d))

    def fwd_args(d):
        return {n: d[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state",
                                  "output_final_state", "cu_seqlens")}

    def measure(entries):
        rows = []
        for p, d in problems:
            times = {}
            with torch.no_grad():
                for name, fn in entries.items():
                    times[name] = median_ms(functools.partial(fn, d), d["q"].device, warmup=3, repeat=20)
                    log(f"{p.label} {name} {times[name]:.3f} ms")
            rows.append((p.label, times))
        return rows

    scale = 128 ** -0.5
    ours = measure({
        "promoted": lambda d: fwd.forward(d["q"], d["k"], d["v"], d["g"], d["beta"], scale,
                                          d["initial_state"], True, d["cu_seqlens"]),
        "s04 run": lambda d: s04.run(**fwd_args(d)),
        "s03 kernel": lambda d: s03.fused_h_o(d["q"], d["k"], d["w"], d["u"], d["g_cum"],
                                              d["initial_state"], d["cu_seqlens"], scale),
        "s04 kernel": lambda d: s04.fused_reform(d["q"], d["k"], d["v"], d["ab"], d["g_cum"],
                                                 d["gated"], d["initial_state"], d["cu_seqlens"],
                                                 scale),
        "fwd_intra": lambda d: intra.run(d["k"], d["v"], d["g_cum"], d["beta"], d["cu_seqlens"]),
        "solve": lambda d: solve.solve(d["k"], d["beta"], d["g_cum"], d["cu_seqlens"]),
        "solve 1/CTA": lambda d: solve.solve(d["k"], d["beta"], d["g_cum"], d["cu_seqlens"],
                                             heads_per_cta=1),
    })
    for p, d in problems:
        want = fwd.forward(d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"],
                           True, d["cu_seqlens"])
        got = s04.run(**fwd_args(d))
        print(p.label, "s04 vs promoted: o rel diff", f"{rel_l2(got[0], want[0]):.2e}",
              "final state", f"{rel_l2(got[1], want[1]):.2e}", flush=True)
    _table("our kernels", ours)
    warm(("gdn_fwd.s00", "gdn_fwd.s03"))
    peers = measure({"FLA fwd": lambda d: s00.run(**fwd_args(d)),
                     "s03 run": lambda d: s03.run(**fwd_args(d))})
    _table("all", [(label, {**t2, **t1}) for (label, t1), (_, t2) in zip(ours, peers)])


if __name__ == "__main__":
    if len(sys.argv) > 2:  # a time limit in seconds: dump every thread's stack shortly before it
        import faulthandler
        faulthandler.dump_traceback_later(float(sys.argv[2]) - 10)
    {"errors": errors, "timing": timing}[sys.argv[1]]()
