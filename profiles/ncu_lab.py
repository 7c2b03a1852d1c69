"""Lab: Nsight Compute on one stage, through its NVTX range; a roofline drawn from the result.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/ncu_lab.py profile STAGE_ID OUT.csv [--commit SHA] [--problem H,HV,LEN[+LEN...]]

STAGE_ID is a ``flashqla.stages.discover()`` id such as ``gdn_fwd.s00``, ``chunk_kkt.s01`` or
``gdn_bwd.s03``, or ``FlashQLA`` for the peer's forward, ``FlashQLA.bwd`` for its backward (its
kernels, inside an NVTX range of that name; the backward's forward runs outside it). The
``profile`` step runs, as a child process,

    ncu --nvtx --nvtx-include "flashqla@STAGE_ID/" --profile-from-start off --clock-control none
        --csv --page raw --section ... --metrics ... python3 profiles/ncu_lab.py target STAGE_ID

The ``target`` step builds the problem (PROBLEM_ARGS, or ``--problem``: e.g. ``2,8,32768``, which
AutoCP splits, for the warm-up and chaining kernels), takes the stage's op inputs
(``flashqla.testing.op_inputs``) and calls ``stage.module.run`` twice: the first call compiles
(TileLang) or autotunes (Triton) outside the profiled window; only the second lies between
``cudaProfilerStart`` and ``cudaProfilerStop``. So ncu profiles every kernel launched inside the
stage's NVTX range during that one call, each replayed once per counter pass with the caches
flushed before each pass (ncu's default), at the card's own clocks: times are of a cold-cache
replay and can differ a little from ``python -m flashqla bench``. After ncu, the same step
measures the roofs (outside ncu), writes one row per kernel to OUT.csv and prints them:

    stage, kernel       the stage id; the kernel's function name (no template arguments)
    us                  kernel duration under ncu (gpu__time_duration)
    dram_mb             bytes read + written in DRAM (dram__bytes_read + dram__bytes_write), MB
    dram_gbs, dram_pct  dram_mb / us in GB/s; DRAM throughput in % of the card's peak
                        (gpu__dram_throughput)
    sm_pct              SM throughput: the busiest SM unit, % of its peak (sm__throughput)
    tensor_pct          tensor pipe busy, % of elapsed cycles (TENSOR_PCT; 94 % for cuBLAS's
                        8192^3 bf16 matmul on an H200)
    gflop               FLOPs executed on the tensor cores, bf16 or tf32 sources, fp32 accumulate
                        (TENSOR_FLOP: wgmma and mma.sync alike; 0 for kernels without). Checked:
                        exactly 2 * 64 * 64 * 128 per (chunk, value head) for chunk_kkt.s01, and
                        2 * 8192^3 + 1.6 % for the matmul, whose 320-row tiles pad 8192 to 8320
                        rows: it counts what the tensor cores execute, padding included
    tflops              gflop / us (tensor FLOPs only)
    occupancy_pct       achieved occupancy: active warps per SM, % of the maximum
    regs, smem_kb       registers per thread; shared memory per block (static + dynamic), KiB
    grid, block         grid and block dimensions, XxYxZ
    stalls              the 3 largest stall reasons, in warps stalled per issued instruction
                        (smsp__average_warps_issue_stalled_<reason>_per_issue_active)
    gpu ... problem     provenance: card, driver, CUDA, torch, TileLang, fla, flash-qla, commit,
                        date, ncu version, problem
    copy_roof_gbs       a 1 GiB device copy, GB/s (bytes read + written), measured in this run
    bf16_roof_tflops    an 8192^3 bf16 matmul, TFLOP/s, measured in this run

On any machine:

    python3 profiles/ncu_lab.py report IN.csv [IN.csv ...] OUT.png

draws, from the CSVs, the roofline: arithmetic intensity (tensor FLOPs per DRAM byte) against
achieved TFLOP/s, log-log, under the roof min(bf16 matmul peak, copy bandwidth x intensity); a
kernel under the sloped part is bound by DRAM bandwidth, under the flat part by the tensor cores,
and its distance below the roof is what is left on the table. Kernels with no tensor FLOPs cannot
sit on it; the second panel places every kernel by DRAM bytes and time alone (GB/s against the
copy roof). The roofs are those of the first CSV. Committed in ``profiles/results/``:
``ncu_gdn_fwd_s00.csv``, ``ncu_chunk_kkt_s01.csv`` and their ``ncu_roofline.png``; also the fused
kernels of s03, s05, s07 and s12 (``ncu_gdn_fwd_sNN.csv``), the three gate-free solves
(``ncu_gate_free_solve_sNN.csv``), FlashQLA's forward (``ncu_flashqla.csv``) and, in
``ncu_targets.csv``, six runs of the one H100 call (ae1f15b) concatenated: the library's forward
(gdn_fwd.s44) and FlashQLA's on (16, 64) 1x32768 and on (2, 8) 1x2048, FLA's (gdn_fwd.s00) on
(2, 8) 1x2048, and gdn_fwd.s44 on (8, 24) 1x2048. The Nsight labs page of the book reads
them.
"""

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROBLEM_ARGS = (16, 64, (8192,))  # flashqla.testing.Problem: (H, HV) = (16, 64), 1 x 8192 tokens
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
TENSOR_PCT = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"
TENSOR_FLOP = ("sm__ops_path_tensor_src_bf16_dst_fp32.sum",
               "sm__ops_path_tensor_src_tf32_dst_fp32.sum")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", TENSOR_PCT, *TENSOR_FLOP)
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def find_stage(stage_id: str):
    from flashqla.stages import discover

    for stage in discover():
        if stage.id == stage_id:
            return stage
    raise SystemExit(f"ncu_lab: no stage `{stage_id}`; have {[s.id for s in discover()]}")


def flashqla_peer(**inputs):
    """FlashQLA's forward (flash-qla's ``chunk_gated_delta_rule``) inside an NVTX range of its own
    name, so that it is profiled as a stage is: the id ``FlashQLA``."""
    import flash_qla

    from flashqla.nvtx import nvtx_range

    with nvtx_range("FlashQLA"):
        return flash_qla.chunk_gated_delta_rule(**inputs)


def flashqla_peer_backward(q, k, v, g, beta, do, dht, scale=None, initial_state=None, cu_seqlens=None):
    """FlashQLA's backward: its forward through autograd, then the gradients of q, k, v, g, beta and
    the initial state for do and dht inside an NVTX range ``FlashQLA.bwd`` (the id ``FlashQLA.bwd``),
    so that only the backward's kernels are profiled."""
    import flash_qla
    import torch

    from flashqla.nvtx import nvtx_range

    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta, initial_state)]
    with torch.enable_grad():
        o, ht = flash_qla.chunk_gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5],
                                                 output_final_state=True, cu_seqlens=cu_seqlens)
    with nvtx_range("FlashQLA.bwd"):
        return torch.autograd.grad((o, ht), leaves, (do, dht))


PEERS = {"FlashQLA": ("gdn_fwd", flashqla_peer), "FlashQLA.bwd": ("gdn_bwd", flashqla_peer_backward)}


def find_target(stage_id: str) -> tuple:
    """(op, run) of a stage id or a peer's (``PEERS``)."""
    if stage_id in PEERS:
        return PEERS[stage_id]
    stage = find_stage(stage_id)
    return stage.op, stage.module.run


def parse_problem(text: str | None) -> tuple:
    """``H,HV,LEN[+LEN...]`` -> ``flashqla.testing.Problem``'s (H, HV, lengths); None: PROBLEM_ARGS."""
    if text is None:
        return PROBLEM_ARGS
    H, HV, lengths = text.split(",")
    return int(H), int(HV), tuple(int(n) for n in lengths.split("+"))


def target(stage_id: str, problem: str | None) -> None:
    """The profiled process: one untimed call, then one call inside the profiler window."""
    import torch

    from flashqla.testing import Problem, op_inputs

    op, run = find_target(stage_id)
    inputs = op_inputs(op, Problem(*parse_problem(problem)).inputs("cuda"))
    run(**inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run(**inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def ncu_command(stage_id: str, log: str, problem: str | None) -> list[str]:
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    return ["ncu", "--nvtx", "--nvtx-include", f"flashqla@{stage_id}/",
            "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
            "--print-units", "base", "--print-kernel-base", "function", *sections,
            "--metrics", ",".join(METRICS), "--log-file", log,
            sys.executable, __file__, "target", stage_id, *(["--problem", problem] if problem else [])]


def parse_raw(text: str) -> list[dict]:
    """ncu's raw page (quoted CSV: a header, a units row, one row per kernel) as dicts."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    return [dict(zip(rows[0], r)) for r in rows[1:] if r[0]]


def summarize(stage_id: str, raw: dict) -> dict:
    def metric(name):
        return float(raw[name].replace(",", ""))

    us = metric("gpu__time_duration.sum") / 1e3
    dram = metric("dram__bytes_read.sum") + metric("dram__bytes_write.sum")
    flop = sum(metric(name) for name in TENSOR_FLOP)
    # "selected" is the issuing warp itself (always 1), not a stall
    stalls = sorted(((metric(k), m.group(1)) for k in raw
                     if (m := STALL.fullmatch(k)) and m.group(1) != "selected"), reverse=True)
    return dict(stage=stage_id, kernel=raw["Kernel Name"], us=round(us, 2),
                dram_mb=round(dram / 1e6, 2), dram_gbs=round(dram / us / 1e3),
                dram_pct=round(metric("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"), 1),
                sm_pct=round(metric("sm__throughput.avg.pct_of_peak_sustained_elapsed"), 1),
                tensor_pct=round(metric(TENSOR_PCT), 1), gflop=round(flop / 1e9, 3),
                tflops=round(flop / us / 1e6, 1),
                occupancy_pct=round(metric("sm__warps_active.avg.pct_of_peak_sustained_active"), 1),
                regs=int(metric("launch__registers_per_thread")),
                smem_kb=round((metric("launch__shared_mem_per_block_static")
                               + metric("launch__shared_mem_per_block_dynamic")) / 1024, 1),
                grid="x".join(raw["Grid Size"].strip("()").split(", ")),
                block="x".join(raw["Block Size"].strip("()").split(", ")),
                stalls="; ".join(f"{name} {v:.2f}" for v, name in stalls[:3]))


def profile(stage_id: str, out_csv: str, commit: str, problem: str | None) -> None:
    with tempfile.NamedTemporaryFile(suffix=".csv") as log:
        subprocess.run(ncu_command(stage_id, log.name, problem), check=True)
        kernels = parse_raw(Path(log.name).read_text())
    if not kernels:
        raise SystemExit(f"ncu_lab: ncu profiled no kernel inside the NVTX range `{stage_id}`")
    rows = [summarize(stage_id, k) for k in kernels]

    from flashqla.bench import versions, roofs
    from flashqla.testing import Problem

    ncu_version = next(line.split()[1] for line in subprocess.run(
        ["ncu", "--version"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Version"))
    tflops_roof, gbs_roof = roofs()
    provenance = dict(**versions(commit), ncu=ncu_version, problem=Problem(*parse_problem(problem)).label,
                      copy_roof_gbs=round(gbs_roof), bf16_roof_tflops=round(tflops_roof))
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(provenance))
        w.writeheader()
        w.writerows({**r, **provenance} for r in rows)
    print(f"{stage_id} on {provenance['gpu']}, {provenance['problem']}, ncu {ncu_version}; "
          f"roofs: copy {gbs_roof:.0f} GB/s, bf16 matmul {tflops_roof:.0f} TFLOP/s")
    cols = dict(us="us", dram_gbs="GB/s", dram_pct="%DRAM", sm_pct="%SM", tensor_pct="%tensor",
                tflops="TFLOP/s", occupancy_pct="%occup", regs="regs", smem_kb="smem KB",
                grid="grid", block="block")
    print(f"{'kernel':40} " + " ".join(f"{h:>9}" for h in cols.values()) + "  top stalls")
    for r in rows:
        print(f"{r['kernel'][:40]:40} " + " ".join(f"{r[c]:>9}" for c in cols) + f"  {r['stalls']}")


def report(in_csvs: list[str], out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for path in in_csvs for r in csv.DictReader(open(path, newline=""))]
    tflops_roof, gbs_roof = float(rows[0]["bf16_roof_tflops"]), float(rows[0]["copy_roof_gbs"])
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    color = {st: f"C{i}" for i, st in enumerate(stages)}
    fig, (roof, bw) = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw=dict(width_ratios=(1, 1)))

    # roofline: TFLOP/s <= min(matmul peak, copy GB/s x FLOP/byte / 1000); ridge where they meet
    ridge = tflops_roof * 1e3 / gbs_roof
    x = [ridge / 300, ridge, ridge * 30]
    roof.plot(x, [min(tflops_roof, gbs_roof * ai / 1e3) for ai in x], "k-", lw=1.5)
    roof.text(ridge, tflops_roof * 1.15, f"bf16 matmul {tflops_roof:.0f} TFLOP/s", fontsize=8)
    roof.text(ridge / 250, gbs_roof * ridge / 100 / 1e3, f"copy {gbs_roof:.0f} GB/s", fontsize=8)
    for i, r in enumerate(rows, 1):
        flop, nbytes = float(r["gflop"]) * 1e9, float(r["dram_mb"]) * 1e6
        if flop > 0 and nbytes > 0:
            roof.plot(flop / nbytes, float(r["tflops"]), "o", color=color[r["stage"]])
            roof.annotate(str(i), (flop / nbytes, float(r["tflops"])), fontsize=8,
                          xytext=(5, 3), textcoords="offset points")
    roof.set(xscale="log", yscale="log", ylim=(tflops_roof / 1000, tflops_roof * 2),
             xlabel="arithmetic intensity (tensor FLOP / DRAM byte)",
             ylabel="achieved tensor TFLOP/s", title="roofline: kernels with tensor FLOPs")
    roof.grid(True, which="both", lw=0.3)

    # every kernel by DRAM bytes and time alone
    bw.barh(range(len(rows)), [float(r["dram_gbs"]) for r in rows],
            color=[color[r["stage"]] for r in rows])
    bw.axvline(gbs_roof, color="k", lw=1.5)
    bw.set_yticks(range(len(rows)), [f"{r['stage']}: {r['kernel'][:48]}  {i}"
                                     for i, r in enumerate(rows, 1)], fontsize=7)
    bw.invert_yaxis()
    bw.set(xlabel="achieved DRAM GB/s (line: copy roof)", title="DRAM traffic: every kernel")
    meta = rows[0]
    fig.suptitle(f"Nsight Compute {meta['ncu']} on {meta['gpu']}, problem {meta['problem']}, "
                 f"commit {meta['commit']}, {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="profiles/ncu_lab.py")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("profile", help="run ncu on one stage and write OUT.csv (GPU)")
    p.add_argument("stage_id")
    p.add_argument("out_csv")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--problem", help="H,HV,LEN[+LEN...] (default: PROBLEM_ARGS)")
    t = sub.add_parser("target", help="the process ncu profiles")
    t.add_argument("stage_id")
    t.add_argument("--problem")
    r = sub.add_parser("report", help="draw the roofline from CSVs (any machine)")
    r.add_argument("paths", nargs="+", metavar="IN.csv ... OUT.png")
    args = parser.parse_args()
    if args.mode == "profile":
        profile(args.stage_id, args.out_csv, args.commit, args.problem)
    elif args.mode == "target":
        target(args.stage_id, args.problem)
    else:
        report(args.paths[:-1], args.paths[-1])


if __name__ == "__main__":
    main()
