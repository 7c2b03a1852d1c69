"""Every chapter runs top to bottom on this machine (CPU is enough), as a learner would run it."""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_recurrence.py", "02_chunked_form.py", "03_forward_kernels.py",
                                           "04_reformulation.py", "05_autocp.py", "06_backward.py"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    import jupytext  # dev dependencies, imported here so that `pytest -m gpu` collects without them
    import nbclient

    nb = jupytext.read(path)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
