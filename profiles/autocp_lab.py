"""Lab: gdn_fwd.s06 (AutoCP) against the stage it runs (s03) over sequence lengths.

Run on the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/autocp_lab.py COMMIT OUT.csv

One sequence of 2048 .. 65536 tokens, heads (2, 8) (few chains: CP's case) and (16, 64) (128
CTAs on 132 SMs without CP: the rule keeps it off). Rows: s03; s06 as ``run`` calls it (the rule
decides); s06 forced on (``cp=True``: the rule's segment length even where it would not split).
Every row is timed twice in the same run: CUDA events around eager calls (median of 20 after 3
warm-up calls; includes the host's launch overhead wherever it exceeds the GPU time) and CUDA-graph
replay of one call (median of 20). One input set per problem (not rotated through L2). Each row
also records the plan (L chunks per segment, J segments) and how far its o is from s03's. Then it
prints the time of each piece of s06 on (2, 8) (not in the CSV).
"""

import concurrent.futures
import csv
import datetime
import statistics
import subprocess
import sys

import torch

from flashqla import autocp
from flashqla.stages import load
from flashqla.testing import Problem, rel_l2

HEADS = ((2, 8), (16, 64))
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)
REPEAT = 20


def events_ms(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPEAT):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return events_ms(graph.replay)


def breakdown(s03, s06, x, sms) -> str:
    """Graph-replay ms of each piece of s06.forward on one problem (the same calls, one by one)."""
    B, T, H, K = x["q"].shape
    HV, V = x["v"].shape[2], x["v"].shape[3]
    q, k, v, g, beta, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    cumsum, kkt, solve, w_u = (load(op, n).run for op, n in s03.PREP_STAGES)

    def prep():
        g_cum = cumsum(g, cu, 64)
        return g_cum, w_u(k, v, beta, solve(kkt(k, g_cum, beta, cu, 64), cu, 64), g_cum, cu, 64)

    g_cum, (w, u) = prep()
    g_cum, w, u = g_cum.contiguous(), w.contiguous(), u.contiguous()
    p = autocp.plan(cu, B, T, HV, sms, 2, q.device)
    N, J = p.num_seqs, p.max_segments
    win, exact, _ = autocp.warmup(p, g_cum.view(B * T, HV), autocp.bound_violations(k, g, beta))
    z = torch.empty(J * N, HV, K, V, device="cuda")
    m = torch.empty(J * N, HV, K, K, device="cuda")
    hs = torch.zeros(J, N * HV, K, V, device="cuda")
    kern = s06._compiled(H, HV)
    h_seg = hs.view(J * N, HV, K, V).index_select(0, p.slot_of_segment)
    pieces = {
        "prep (4 stages)": prep,
        "plan: bound check + windows": lambda: autocp.warmup(
            p, g_cum.view(B * T, HV), autocp.bound_violations(k, g, beta)),
        "phase 1 kernel": lambda: kern(k.view(B * T, H, K), w.view(B * T, HV, K), u.view(B * T, HV, V),
                                       g_cum.view(B * T, HV), win, p.slot_start, exact, z, m),
        "phase 2 chaining": lambda: [torch.baddbmm(z.view(J, -1, K, V)[j], m.view(J, -1, K, K)[j],
                                                   hs[j - 1], out=hs[j]) for j in range(1, J)],
        "phase 3 fused kernel (segments)": lambda: s03.fused_h_o(q, k, w, u, g_cum, h_seg, p.bounds,
                                                                 K ** -0.5),
        "s03 fused kernel (whole)": lambda: s03.fused_h_o(q, k, w, u, g_cum, x["initial_state"], cu,
                                                          K ** -0.5),
    }
    return "\n".join(f"  {name:34s} {graph_ms(fn):8.3f} ms" for name, fn in pieces.items())


def main(commit: str, out_csv: str) -> None:
    import tilelang

    s03, s06 = load("gdn_fwd", 3), load("gdn_fwd", 6)
    sms = autocp.num_sms("cuda")
    tiny = [Problem(H, HV, (700,)).inputs("cuda") for H, HV in HEADS]  # compile on threads first
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda x: s06.forward(**x, cp=2), tiny))
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=torch.cuda.get_device_name(), sms=sms, driver=driver, cuda=torch.version.cuda,
                torch=torch.__version__, tilelang=tilelang.__version__, commit=commit,
                date=datetime.date.today().isoformat(),
                method="median of 20: CUDA events around eager calls / CUDA-graph replay")
    rows = []
    for H, HV in HEADS:
        for T in LENGTHS:
            x = Problem(H, HV, (T,), varlen=False).inputs("cuda")
            ref_o = s03.run(**x)[0]
            impls = [("s03", lambda: s03.run(**x), False),
                     ("s06 auto", lambda: s06.run(**x), None),
                     ("s06 forced on", lambda: s06.forward(**x, cp=True), True)]
            for name, fn, force in impls:
                L = 0 if force is False else autocp.segment_chunks(T, 1, T, HV, sms, 2, force)
                with torch.no_grad():
                    diff = rel_l2(fn()[0], ref_o)
                    ms_events, ms_graph = events_ms(fn), graph_ms(fn)
                rows.append(dict(heads=f"({H}, {HV})", H=H, HV=HV, tokens=T, impl=name,
                                 segment_chunks=L, segments=-(-T // (64 * L)) if L else 1,
                                 ms_events=round(ms_events, 4), ms_graph=round(ms_graph, 4),
                                 rel_diff_vs_s03=f"{diff:.2e}", **meta))
                print(f"({H:2d}, {HV:2d}) {T:6d} {name:14s} L={L:4d} events {ms_events:8.3f} ms "
                      f"graph {ms_graph:8.3f} ms  |o - o_s03| / |o_s03| = {diff:.1e}", flush=True)
            del x
            torch.cuda.empty_cache()
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for T in (8192, 65536):
        print(f"s06 pieces, (2, 8) 1 x {T}, CUDA-graph replay:", flush=True)
        print(breakdown(s03, s06, Problem(2, 8, (T,), varlen=False).inputs("cuda"), sms), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
