"""The backward lab: gdn_bwd's stages against FLA 0.6.0's backward, and s01's sub-kernels, in one run.

    python3 profiles/gdn_bwd_s01_lab.py [OUT_DIR] [--only bwd|kernels] [--after DONE_FILE]

bwd: gdn_bwd.s01 and gdn_bwd.s02 (recompute + backward; s02 also with its walk kernel built for
BV = 32 value columns per CTA instead of 64) against torch autograd through
fla.ops.gated_delta_rule.chunk_gated_delta_rule (FLA_FLASH_QLA=0 times FLA itself: forward once,
then ``torch.autograd.grad`` with retain_graph times only its backward) on (16, 64) 1 x 32768,
(2, 8) 1 x 32768 and (16, 32) 8 x 4096 varlen; each stage's gradients are compared with FLA's
(relative L2), and each one's time is split over its kernels with the PyTorch profiler (device
time of each kernel, mean of 5 calls).

kernels: chunk_bwd_dv_local.s01 vs fla.ops.common.chunk_o.chunk_bwd_dv_local,
chunk_bwd_dhu.s01 vs fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_dhu, and each step of
gdn_bwd.s01 alone, on (16, 64) and (2, 8), 1 x 32768.

CUDA events, median of 20 after 3 warm-up calls; K = V = 128, h0 and dht given. The table is
printed last. On a fresh H200, ``--only bwd`` takes about 6 minutes: compiling our stages ~40 s,
FLA's first forward and backward ~90 s per head configuration; ``--after`` lets the GPU tests run
meanwhile.
"""

import argparse
import collections
import functools
import math
import os
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402

from flashqla.stages import discover, load  # noqa: E402
from flashqla.testing import Problem, rel_l2, warm_up  # noqa: E402
from flashqla.timing import median_ms  # noqa: E402

TOKENS = 32768
KERNEL_SHAPES = ((16, 64), (2, 8))
BWD_PROBLEMS = (Problem(16, 64, (TOKENS,), varlen=False), Problem(2, 8, (TOKENS,), varlen=False),
                Problem(16, 32, (4096,) * 8))
BWD_STAGES = (1, 2)
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def time_ms(fn):
    return median_ms(fn, torch.device("cuda"), warmup=3, repeat=20)


def upstream(x):
    """Fixed random dO (bf16) and dht (fp32) for the inputs x."""
    gen = torch.Generator("cuda").manual_seed(2)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, device="cuda")
    return do, dht


def kernel_ms(fn, calls=5):
    """{kernel name: device ms per call of fn}, from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = collections.Counter()
    for evt in prof.key_averages():
        if evt.device_time_total > 0:
            out[evt.key] += evt.device_time_total / 1e3 / calls
    return dict(out)


def walk_variants(mod, heads, bv):
    """gdn_bwd.s02's walk kernel compiled with BV = bv value columns per CTA, per (H, HV), on threads."""
    import concurrent.futures

    import tilelang

    from flashqla.hopper import HOPPER_TARGET

    def build(hh):
        return tilelang.compile(mod.walk_kernel(*hh, bv), target=HOPPER_TARGET,
                                pass_configs={"tl.disable_shared_memory_reuse": True})

    with concurrent.futures.ThreadPoolExecutor(len(heads)) as pool:
        return dict(zip(heads, pool.map(build, heads)))


def bwd_rows(log, after=None):
    """(problem, {implementation: ms}) and (problem, implementation, kernel, ms) rows for the whole
    backward: gdn_bwd.s01, s02, s02 with BV = 32 (its walk variant), FLA.

    First everything is compiled (TileLang stages on threads, FLA by one forward and backward per
    problem); with ``after`` (a file that another job, e.g. the GPU tests, creates when done) the
    timing then waits for that file, so that the two can share one machine session."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    start = time.time()
    mods = {s: load("gdn_bwd", s) for s in BWD_STAGES}
    heads = sorted({(p.H, p.HV) for p in BWD_PROBLEMS})
    warm = [st for st in discover() if (st.op, st.number) in mods[1].STEPS
            or (st.op == "gdn_bwd" and st.number == 2 and after is None)]
    warm_up(warm, heads=heads)
    bv32 = walk_variants(mods[2], heads, 32)
    print(f"[{time.time() - start:.0f} s] compiled", flush=True)
    s02_walk = mods[2]._walk

    def s02_bv32(*args):
        mods[2]._walk = lambda H, HV: bv32[(H, HV)]
        try:
            return mods[2].run(*args)
        finally:
            mods[2]._walk = s02_walk

    runs = {"s01": mods[1].run, "s02": mods[2].run, "s02 BV=32": s02_bv32}
    problems = []
    for p in BWD_PROBLEMS:
        x = p.inputs(device="cuda", seed=1)
        q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state",
                                                    "cu_seqlens"))
        scale = q.shape[-1] ** -0.5
        do, dht = upstream(x)
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
        o, ht = chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                       output_final_state=True,
                                       cu_seqlens=None if cu is None else cu.long())
        fla_bwd = functools.partial(torch.autograd.grad, (o, ht), leaves, (do, dht), retain_graph=True)
        problems.append((p, (q, k, v, g, beta, do, dht, scale, h0, cu), fla_bwd, fla_bwd()))
        print(f"[{time.time() - start:.0f} s] FLA ran on {p.label}", flush=True)
    while after is not None and not os.path.exists(after):
        time.sleep(1)
    print(f"[{time.time() - start:.0f} s] timing", flush=True)

    rows, steps = [], []
    for p, args, fla_bwd, fla in problems:
        times = {}
        for name, fn in runs.items():
            ours = fn(*args)
            log.append(f"{p.label} gdn_bwd {name} rel diff vs FLA: " + " ".join(
                f"{n} {rel_l2(a, b):.2e}" for n, a, b in zip(GRADS, ours, fla)))
            print(log[-1], flush=True)
            del ours
            times[name] = time_ms(lambda: fn(*args))  # noqa: B023
        times["FLA"] = time_ms(fla_bwd)
        rows.append((p.label, times))
        print(p.label, {n: round(t, 3) for n, t in times.items()}, flush=True)
        try:
            for name, fn in runs.items():
                for kernel, ms in kernel_ms(lambda: fn(*args)).items():  # noqa: B023
                    steps.append((p.label, name, kernel, ms))
        except Exception as e:  # noqa: BLE001 (no CUPTI: the totals above stand)
            log.append(f"{p.label} profiler failed: {e!r}")
    return rows, steps


def kernel_rows(log):
    """(shape, name, ours ms, FLA ms) for s01's sub-kernels, FLA's where it has one."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
    from fla.ops.common.chunk_o import chunk_bwd_dv_local

    rows = []
    for H, HV in KERNEL_SHAPES:
        x = Problem(H, HV, (TOKENS,), varlen=False).inputs(device="cuda", seed=1)
        q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
        scale = q.shape[-1] ** -0.5
        do, dht = upstream(x)
        g_cum = load("chunk_local_cumsum", 1).run(g)
        Ai = load("kkt_solve", 1).run(load("chunk_kkt", 2).run(k, g_cum, beta))
        w, u = load("chunk_w_u", 1).run(k, v, beta, Ai, g_cum)
        g2 = g_cum / math.log(2)                                # FLA's gates: log2 units

        dvl_mod, dhu_mod, bwd_mod = (load(op, 1)
                                     for op in ("chunk_bwd_dv_local", "chunk_bwd_dhu", "gdn_bwd"))
        dvl = dvl_mod.run(q, k, do, g_cum, scale)
        fla = chunk_bwd_dv_local(q, k, do, g=g2, scale=scale)
        log.append(f"({H},{HV}) dv_local rel diff vs FLA {rel_l2(dvl, fla):.2e}")
        rows.append((f"({H}, {HV})", "chunk_bwd_dv_local.s01",
                     time_ms(lambda: dvl_mod.run(q, k, do, g_cum, scale)),
                     time_ms(lambda: chunk_bwd_dv_local(q, k, do, g=g2, scale=scale))))

        dh, _, dv2 = ours = dhu_mod.run(q, k, w, g_cum, h0, dht, do, dvl, scale)
        fla = chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dvl, g=g2, h0=h0, dht=dht, scale=scale)
        log.append(f"({H},{HV}) dhu rel diff vs FLA: dh {rel_l2(ours[0], fla[0]):.2e} "
                   f"dh0 {rel_l2(ours[1], fla[1]):.2e} dv2 {rel_l2(ours[2], fla[2]):.2e}")
        rows.append((f"({H}, {HV})", "chunk_bwd_dhu.s01",
                     time_ms(lambda: dhu_mod.run(q, k, w, g_cum, h0, dht, do, dvl, scale)),
                     time_ms(lambda: chunk_gated_delta_rule_bwd_dhu(q, k, w, do, dvl, g=g2, h0=h0,
                                                                    dht=dht, scale=scale))))

        # where gdn_bwd.s01's time goes: each of its steps alone (no FLA column)
        h, v_new, _ = load("chunk_h", 1).run(k, w, u, g_cum, h0)
        _, _, dw, dg_cum = load("chunk_bwd_dqkwg", 1).run(q, k, v_new, g_cum, h, dv2, do, dh, scale)
        steps = (("  recompute g_cum, Ai, w, u", lambda: load("chunk_w_u", 1).run(
                     k, v, beta, load("kkt_solve", 1).run(load("chunk_kkt", 2).run(
                         k, load("chunk_local_cumsum", 1).run(g), beta)), g_cum)),
                 ("  recompute chunk_h.s01", lambda: load("chunk_h", 1).run(k, w, u, g_cum, h0)),
                 ("  chunk_bwd_dqkwg.s01", lambda: load("chunk_bwd_dqkwg", 1).run(
                     q, k, v_new, g_cum, h, dv2, do, dh, scale)),
                 ("  wy_bwd.s01", lambda: load("wy_bwd", 1).run(k, v, beta, Ai, g_cum, dw, dv2)),
                 ("  reverse cumsum (PyTorch)",
                  lambda: bwd_mod._chunk_local_reverse_cumsum(dg_cum, None)))
        rows += [(f"({H}, {HV})", name, time_ms(fn), float("nan")) for name, fn in steps]
        torch.cuda.empty_cache()
    return rows


def main(out_dir, only, after):
    log, table = [], [f"{torch.cuda.get_device_name()}, K = V = 128, h0 and dht, median ms of 20 "
                      f"(CUDA events)"]
    if only in (None, "kernels"):
        rows = kernel_rows(log)
        table += ["", f"1 x {TOKENS} tokens: s01's sub-kernels",
                  f"{'(H, HV)':9} {'stage':32} {'flashqla':>9} {'FLA':>9} {'FLA/ours':>9}"]
        table += [f"{s:9} {name:32} {a:9.3f} {b:9.3f} {b / a:9.2f}" for s, name, a, b in rows]
    if only in (None, "bwd"):
        rows, steps = bwd_rows(log, after)
        table += ["", "by kernel (profiler, device ms per call)"]
        table += [f"{label:24} {name:10} {kernel[:48]:48} {ms:8.3f}" for label, name, kernel, ms in steps]
        table += ["", "whole backward (recompute + backward)",
                  f"{'problem':24} {'s01':>8} {'s02':>8} {'s02 BV=32':>10} {'FLA':>8} {'FLA/s01':>8} "
                  f"{'FLA/s02':>8}"]
        table += [f"{label:24} {t['s01']:8.3f} {t['s02']:8.3f} {t['s02 BV=32']:10.3f} {t['FLA']:8.3f} "
                  f"{t['FLA'] / t['s01']:8.2f} {t['FLA'] / t['s02']:8.2f}" for label, t in rows]
    text = "\n".join(log + [""] + table)
    print(text)
    if out_dir:
        with open(os.path.join(out_dir, "gdn_bwd_lab.txt"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--only", choices=("bwd", "kernels"))
    parser.add_argument("--after", help="bwd: compile first, then wait for this file before timing")
    args = parser.parse_args()
    main(args.out_dir, args.only, args.after)
