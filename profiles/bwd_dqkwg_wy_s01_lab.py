"""Times chunk_bwd_dqkwg.s01 and wy_bwd.s01 against FLA 0.6.0 on the same inputs, in one run.

    python3 profiles/bwd_dqkwg_wy_s01_lab.py [OUT_DIR]

Rows: chunk_bwd_dqkwg.s01 vs fla.ops.common.chunk_o.chunk_bwd_dqkwg (on Hopper FLA dispatches it to
its TileLang backend) and wy_bwd.s01 vs fla.ops.gated_delta_rule.wy_fast.prepare_wy_repr_bwd
(Triton). Inputs: q, k, v, g, beta of a public problem, g_cum and Ai from the forward stages,
random bf16 h, dh, v_new, do, dv2 (= du), dw. CUDA events, median of 20 after 3 warm-up calls;
each pair also reports the largest relative L2 difference between the two implementations'
outputs (a cross-check at a large shape) and the bytes our kernel moves at least per ms.
"""

import math
import os
import sys

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402

from flashqla import reference  # noqa: E402
from flashqla.stages import load  # noqa: E402
from flashqla.testing import Problem, rel_l2  # noqa: E402
from flashqla.timing import median_ms  # noqa: E402

SHAPES = ((16, 64), (2, 8))
TOKENS = 32768
C, D = 64, 128


def main(out_dir):
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd

    dev = torch.device("cuda")
    time = lambda fn: median_ms(fn, dev, warmup=3, repeat=20)  # noqa: E731
    dqkwg_mod, wy_mod = load("chunk_bwd_dqkwg", 1), load("wy_bwd", 1)
    rows, log = [], []
    for H, HV in SHAPES:
        x = Problem(H, HV, (TOKENS,), varlen=False).inputs(device="cuda", seed=1)
        q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
        scale = D ** -0.5
        NT = TOKENS // C
        gen = torch.Generator("cuda").manual_seed(2)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=dev).to(torch.bfloat16)

        g_cum = reference.chunk_local_cumsum(g)
        Ai = load("kkt_solve", 1).run(load("chunk_kkt", 2).run(k, g_cum, beta)).to(torch.bfloat16)
        h, dh = rand(1, NT, HV, D, D), rand(1, NT, HV, D, D)
        v_new, do, dv2, dw = (rand(1, TOKENS, HV, D) for _ in range(4))
        g2 = g_cum / math.log(2)                                # FLA's gates: log2 units

        ours = dqkwg_mod.run(q, k, v_new, g_cum, h, dv2, do, dh, scale)
        fla = chunk_bwd_dqkwg(q=q, k=k, v=v_new, do=do, h=h, dh=dh, w=dw, g=g2, dv=dv2, scale=scale)
        diff = {n: rel_l2(a, b) for n, a, b in zip(("dq", "dk", "dw", "dg"), ours, fla)}
        log.append(f"({H}, {HV}) chunk_bwd_dqkwg ours vs FLA rel L2: {diff}")
        t_ours = time(lambda: dqkwg_mod.run(q, k, v_new, g_cum, h, dv2, do, dh, scale))
        t_fla = time(lambda: chunk_bwd_dqkwg(q=q, k=k, v=v_new, do=do, h=h, dh=dh, w=dw, g=g2, dv=dv2,
                                             scale=scale))
        gb = (NT * HV * (2 * D * D * 2 + 4 * C * D * 2 + 2 * C * 4) + NT * H * 4 * C * D * 2) / 1e9
        rows.append(("chunk_bwd_dqkwg", H, HV, t_ours, t_fla, max(diff.values()), gb / t_ours))

        ours = wy_mod.run(k, v, beta, Ai, g_cum, dw, dv2)
        fla = prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=Ai, dw=dw, du=dv2, g=g2)
        diff = {n: rel_l2(a, b) for n, a, b in zip(("dk", "dv", "dbeta", "dg"), ours, fla)}
        log.append(f"({H}, {HV}) wy_bwd ours vs FLA rel L2: {diff}")
        t_ours = time(lambda: wy_mod.run(k, v, beta, Ai, g_cum, dw, dv2))
        t_fla = time(lambda: prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=Ai, dw=dw, du=dv2, g=g2))
        gb = (NT * HV * (C * C * 2 + 4 * C * D * 2 + 4 * C * 4) + NT * H * 2 * C * D * 2) / 1e9
        rows.append(("wy_bwd", H, HV, t_ours, t_fla, max(diff.values()), gb / t_ours))
        print("\n".join(log[-2:]), flush=True)

    table = [f"device: {torch.cuda.get_device_name()}",
             f"{'op':16s} {'(H, HV)':9s} {'tokens':8s} {'s01 ms':>8s} {'FLA ms':>8s} {'FLA/s01':>8s} "
             f"{'max rel diff':>12s} {'s01 TB/s':>9s}"]
    for op, H, HV, t_ours, t_fla, diff, tbs in rows:
        table.append(f"{op:16s} {f'({H}, {HV})':9s} {'1x' + str(TOKENS):8s} {t_ours:8.3f} {t_fla:8.3f} "
                     f"{t_fla / t_ours:8.2f} {diff:12.2e} {tbs:9.2f}")
    text = "\n".join(log + [""] + table)
    if out_dir:
        with open(os.path.join(out_dir, "bwd_dqkwg_wy_s01_timing.txt"), "w") as f:
            f.write(text + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
