"""Lab: chunk_kkt stages against FLA's ``chunk_scaled_dot_kkt_fwd`` and the PyTorch reference.

Run on the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/chunk_kkt_lab.py COMMIT OUT.csv

Every row is measured in the same run with the same method: ``triton.testing.do_bench`` (CUDA
events, warm-up, median), no CUDA graph, inputs larger than L2 for the long rows. Napkin math per
row: FLOPs = 2 C^2 K per (chunk, value head) (the full 64 x 64 product; the kernel computes it
whole and masks); bytes = the minimum traffic: k read once ([T, H, K] bf16), g_cum and beta read
([T, HV] fp32 each), A written ([T, HV, 64] fp32). The roofs are measured in the same run: a
1 GiB device copy (bytes read + written) and an 8192^3 bf16 matmul.
"""

import csv
import datetime
import subprocess
import sys

import torch
import triton
from triton.testing import do_bench

from flashqla import reference
from flashqla.stages import discover
from flashqla.testing import Problem

PROBLEMS = [Problem(16, 64, (32768,)), Problem(16, 32, (4096,) * 8, varlen=False),
            Problem(2, 8, (32768,)), Problem(16, 64, (2048,)), Problem(16, 32, (28672, 4096))]


def roofs() -> tuple[float, float]:
    """(copy GB/s, bf16 matmul TFLOP/s) measured on this card now."""
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    gbs = 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    tflops = 2 * 8192**3 / do_bench(lambda: a @ a, return_mode="median") / 1e9
    return gbs, tflops


def main(commit: str, out_csv: str) -> None:
    from fla.ops.common.chunk_scaled_dot_kkt import chunk_scaled_dot_kkt_fwd
    import fla
    import tilelang

    gbs_roof, tflops_roof = roofs()
    stages = [s for s in discover() if s.op == "chunk_kkt"]
    rows = []
    for p in PROBLEMS:
        x = p.inputs("cuda")
        k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
        g_cum = reference.chunk_local_cumsum(x["g"], cu)
        T = k.shape[0] * k.shape[1]
        n_chunks = sum(-(-n // 64) for n in p.lengths)
        flops = 2 * 64 * 64 * p.K * n_chunks * p.HV
        nbytes = T * p.H * p.K * 2 + 2 * T * p.HV * 4 + T * p.HV * 64 * 4
        fla_cu = None if cu is None else cu.long()
        candidates = [("FLA chunk_scaled_dot_kkt_fwd",
                       lambda: chunk_scaled_dot_kkt_fwd(k, g_cum, beta, fla_cu, 64)),
                      ("reference.chunk_kkt fp32",
                       lambda: reference.chunk_kkt(k.float(), g_cum, beta, cu))]
        candidates += [(s.name, lambda s=s: s.module.run(k, g_cum, beta, cu)) for s in stages]
        fla_ms = None
        for name, fn in candidates:
            ms = do_bench(fn, return_mode="median")
            fla_ms = ms if fla_ms is None else fla_ms
            rows.append(dict(problem=p.label, impl=name, ms=round(ms, 4),
                             vs_fla=round(fla_ms / ms, 2), tflops=round(flops / ms / 1e9, 1),
                             gbs=round(nbytes / ms / 1e6, 0),
                             pct_copy_roof=round(100 * nbytes / ms / 1e6 / gbs_roof, 1)))
    gpu = torch.cuda.get_device_name()
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    provenance = dict(gpu=gpu, driver=driver, cuda=torch.version.cuda, torch=torch.__version__,
                      triton=triton.__version__, tilelang=tilelang.__version__, fla=fla.__version__,
                      commit=commit, date=datetime.date.today().isoformat(),
                      method="triton do_bench median, CUDA events, no graph",
                      copy_roof_gbs=round(gbs_roof), bf16_roof_tflops=round(tflops_roof))
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(provenance))
        w.writeheader()
        for r in rows:
            w.writerow({**r, **provenance})
    print(f"{gpu}, copy roof {gbs_roof:.0f} GB/s, bf16 roof {tflops_roof:.0f} TFLOP/s")
    print(f"{'problem':26} {'impl':30} {'ms':>8} {'xFLA':>6} {'TFLOP/s':>8} {'GB/s':>7} {'%copy':>6}")
    for r in rows:
        print(f"{r['problem']:26} {r['impl']:30} {r['ms']:8.4f} {r['vs_fla']:6.2f} {r['tflops']:8.1f} "
              f"{r['gbs']:7.0f} {r['pct_copy_roof']:6.1f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
