"""Markers, the `--all-stages` option, the chapters executed once, and the rule that a run in which
nothing passed fails.

`gpu` tests skip without a CUDA GPU and `hopper` tests without an SM90 GPU, each with its reason.
The CPU compile tests of stages cover the milestones (the course path) and the library's kernels;
`--all-stages` adds every lab-log stage (run it when TileLang changes). A session whose selected
tests were all skipped (say `pytest -m gpu` on a CPU machine) exits with status 1 instead of
passing silently.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flashqla.hopper import hopper_gpu_missing


def pytest_addoption(parser):
    parser.addoption("--all-stages", action="store_true",
                     help="also compile every lab-log stage for Hopper, not only the milestones "
                          "(run this when TileLang changes)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(
                reason="needs a CUDA GPU: run `python3 -m pytest -m gpu` on the GPU machine"))
        elif "hopper" in item.keywords and hopper_gpu_missing():
            item.add_marker(pytest.mark.skip(reason=hopper_gpu_missing()))


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter else 0
    if exitstatus == 0 and session.testscollected and passed == 0:
        if reporter:
            reporter.ensure_newline()
            reporter.write_line("flashqla: every selected test was skipped; failing the run", red=True)
        session.exitstatus = 1


# ---- the chapters, each executed once a session (test_notebooks, test_exercises and test_book read it)
ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@dataclass
class Executed:
    notebook: object        # the nbformat notebook with its outputs
    seconds: float          # wall time of the execution, the kernel's start included
    error: str | None       # the first failing cell's error, or None
    ipynb: Path             # where the executed notebook was written (the book builds from it)


@pytest.fixture(scope="session")
def execute_chapter(tmp_path_factory):
    """``execute_chapter(path)``: the chapter run top to bottom as a learner runs it, once a session."""
    out = tmp_path_factory.mktemp("chapters")
    done = {}

    def execute(path: Path) -> Executed:
        if path not in done:
            import jupytext  # dev dependencies, imported here so that `pytest -m gpu` collects without them
            import nbclient
            import nbformat

            nb = jupytext.read(path)
            # the chapters' tensors are small: one torch thread per kernel (on 2 cores shared with
            # compiles, a second thread slowed a chapter 2x)
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            start, error = time.perf_counter(), None
            try:
                nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                        resources={"metadata": {"path": str(path.parent)}}).execute()
            except nbclient.exceptions.CellExecutionError as exc:
                error = str(exc)[-3000:]
            seconds = time.perf_counter() - start
            nbformat.write(nb, out / f"{path.stem}.ipynb")
            done[path] = Executed(nb, seconds, error, out / f"{path.stem}.ipynb")
        return done[path]

    return execute


def output_text(cell) -> str:
    """The text a code cell showed: its streams, results and displays (plain text and markdown)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output.get("text", ""))
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
        else:
            data = output.get("data", {})
            parts.extend(data.get(kind, "") for kind in ("text/plain", "text/markdown"))
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)
