"""The tour: the course path's stages on one default problem, checked and timed on this machine.

Rows: the references (the naive recurrence in float64, the chunked form in bf16, which sets the
tolerances), the public API, then the milestone stages (``flashqla.stages.MILESTONES``), or every
stage under ``kernels/`` with ``all_stages``. Each is checked against the float64 chunked reference
with ``flashqla.testing.check_op``. The stages this machine cannot run are listed once, grouped by
the reason; from an installed wheel, which has no ``kernels/``, the tour says that stages need a
checkout. It ends with the next step. Exits 1 if any check fails.
"""

from __future__ import annotations

import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from flashqla import reference
from flashqla.api import chunk_gated_delta_rule
from flashqla.stages import KERNELS_DIR, MILESTONES, Stage, discover
from flashqla.testing import Problem, cast_floats, check_op, op_inputs, rel_l2
from flashqla.timing import median_ms

GPU_PROBLEM = Problem(16, 32, (4000, 1, 2500, 1691))
CPU_PROBLEM = Problem(2, 4, (200, 1, 63), K=64, V=64)
WIDTH = 100  # characters a line of the list of stages not run
NEXT_STEP = ("next: the course starts at notebooks/01_recurrence.py (open the chapters as notebooks with "
             "`python -m flashqla lab`), or run the quick tests: python3 -m pytest -m \"not slow\"")
NO_CHECKOUT = ("stages: none here. They are files under kernels/ in a checkout of the repository, which "
               "an installed wheel does not have: clone the repository and run `python3 -m pip install "
               "-e .` from its root to run them.")
NEXT_STEP_NO_CHECKOUT = "next: clone the repository: the chapters (notebooks/) and the stages (kernels/) are there"


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


def run_tour(stages: list[Stage]) -> tuple[Problem, list[Row], list[tuple[Stage, str]]]:
    """The table's rows (the references, the API, every stage of ``stages`` this machine runs) and
    the stages it cannot run, each with the reason."""
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
    not_run = []
    for stage in stages:
        reason = stage.missing()
        if reason:
            not_run.append((stage, reason))
        else:
            rows.append(_run_checked(stage.name, stage.op, stage.module.run,
                                     op_inputs(stage.op, inputs), device))
    return problem, rows, not_run


def select(stages: list[Stage], all_stages: bool) -> list[Stage]:
    """The milestones in the course path's order, or every stage."""
    if all_stages:
        return stages
    by_id = {s.id: s for s in stages}
    return [by_id[m] for m in MILESTONES if m in by_id]


def not_run_lines(not_run: list[tuple[Stage, str]], milestones_only: bool) -> list[str]:
    """One line per reason, naming the stages it keeps from running, by op: a compact list."""
    if not not_run:
        return []
    what = "milestone stages" if milestones_only else "stages"
    lines = [f"not run on this machine ({len(not_run)} {what}):"]
    by_reason: dict[str, dict[str, list[str]]] = {}
    for stage, reason in not_run:
        by_reason.setdefault(reason, {}).setdefault(stage.op, []).append(f"s{stage.number:02d}")
    for reason, ops in by_reason.items():
        # an op's stages stay on one line (non-breaking spaces) unless they are longer than one
        pieces = [f"{op} {' '.join(numbers)}" for op, numbers in ops.items()]
        pieces = [p if len(p) > WIDTH - 4 else p.replace(" ", "\xa0") for p in pieces]
        text = textwrap.wrap(f"{reason}: " + "; ".join(pieces), WIDTH, initial_indent="  ",
                             subsequent_indent="    ", break_long_words=False)
        lines += [line.replace("\xa0", " ") for line in text]
    return lines


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


def main(plot_path: Path, all_stages: bool = False, kernels_dir: Path = KERNELS_DIR) -> int:
    stages = select(discover(kernels_dir), all_stages)
    with warnings.catch_warnings(record=True) as caught:  # e.g. the API on the reference: said once, below
        warnings.simplefilter("always")
        problem, rows, not_run = run_tour(stages)
    print(format_table(problem, rows))
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"note: {message}")
    if not kernels_dir.is_dir():
        print(NO_CHECKOUT)
    for line in not_run_lines(not_run, not all_stages):
        print(line)
    if not all_stages and kernels_dir.is_dir():
        print("(--all runs every stage, the lab log's too)")
    plot(problem, rows, plot_path)
    print(f"plot saved to {plot_path}")
    print(NEXT_STEP if kernels_dir.is_dir() else NEXT_STEP_NO_CHECKOUT)
    return 1 if any(r.status.startswith("FAILED") for r in rows) else 0
