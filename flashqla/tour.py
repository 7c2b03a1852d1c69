"""The tour: every stage this machine can run, on one default problem, checked and timed.

Rows: the references (the naive recurrence in float64, the chunked form in bf16, which sets the
tolerances), the public API, then every stage under ``kernels/`` in the checkout. Each is checked
against the float64 chunked reference with ``flashqla.testing.check_op``; stages this machine
cannot run are listed with the reason. Exits 1 if any check fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashqla import reference
from flashqla.api import chunk_gated_delta_rule
from flashqla.stages import discover
from flashqla.testing import Problem, cast_floats, check_op, op_inputs, rel_l2
from flashqla.timing import median_ms

GPU_PROBLEM = Problem(16, 32, (4000, 1, 2500, 1691))
CPU_PROBLEM = Problem(2, 4, (200, 1, 63), K=64, V=64)


@dataclass
class Row:
    name: str
    device: str
    err: float | None = None        # rel L2 error of the first output against float64
    bound: float | None = None      # the derived tolerance for it (None: not a checked stage)
    ms: float | None = None
    status: str = "ok"


def _run_checked(name, op, fn, inputs, device) -> Row:
    try:
        checks = check_op(op, fn, inputs)
    except AssertionError as exc:
        return Row(name, str(device), status="FAILED: " + str(exc).splitlines()[-1].strip())
    ms = median_ms(lambda: fn(**inputs), device)
    return Row(name, str(device), checks[0].err, checks[0].bound, ms)


def run_tour() -> tuple[Problem, list[Row]]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = GPU_PROBLEM if device.type == "cuda" else CPU_PROBLEM
    inputs = problem.inputs(device)
    x64 = cast_floats(inputs, torch.float64)
    oracle = reference.chunk_gated_delta_rule_ref(**x64)[0]

    rows = []
    naive = lambda: reference.naive_recurrent_gated_delta_rule(**x64)  # noqa: E731
    rows.append(Row("reference: naive recurrence, float64", str(device), rel_l2(naive()[0], oracle),
                    ms=median_ms(naive, device, warmup=0, repeat=1)))
    x16 = cast_floats(inputs, torch.bfloat16)
    bf16 = lambda: reference.chunk_gated_delta_rule_ref(**x16)  # noqa: E731
    rows.append(Row("reference: chunked, bfloat16", str(device), rel_l2(bf16()[0], oracle),
                    ms=median_ms(bf16, device)))
    rows.append(_run_checked("flashqla.chunk_gated_delta_rule", "gdn_fwd", chunk_gated_delta_rule,
                             inputs, device))
    for stage in discover():
        reason = stage.missing()
        if reason:
            rows.append(Row(stage.name, "-", status=f"skipped: {reason}"))
        else:
            rows.append(_run_checked(stage.name, stage.op, stage.module.run,
                                     op_inputs(stage.op, inputs), device))
    return problem, rows


def format_table(problem: Problem, rows: list[Row]) -> str:
    def fmt(x, spec):
        return format("-" if x is None else format(x, spec), ">9")

    head = f"{'stage':44} {'device':7} {'rel err':>9} {'bound':>9} {'ms':>9}  status"
    lines = [f"problem: {problem.label}, K = {problem.K}, V = {problem.V}, q/k/v bf16, g/beta fp32",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:44} {r.device:7} {fmt(r.err, '.2e')} {fmt(r.bound, '.2e')} "
                     f"{fmt(r.ms, '.3f')}  {r.status}")
    return "\n".join(lines)


def plot(problem: Problem, rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.ms is not None]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(timed)))
    ax.barh([r.name for r in timed], [r.ms for r in timed], color="tab:blue")
    for i, r in enumerate(timed):
        ax.text(r.ms, i, f"  {r.ms:.3g} ms, err {r.err:.1e}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(min(r.ms for r in timed) / 2, max(r.ms for r in timed) * 30)  # room for the labels
    ax.invert_yaxis()
    ax.set_xlabel("median time (ms, log scale)")
    ax.set_title(f"flashqla tour on {timed[0].device}: {problem.label}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(plot_path: Path) -> int:
    problem, rows = run_tour()
    print(format_table(problem, rows))
    plot(problem, rows, plot_path)
    print(f"plot saved to {plot_path}")
    return 1 if any(r.status.startswith("FAILED") for r in rows) else 0
