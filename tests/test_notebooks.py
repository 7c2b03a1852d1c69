"""Every chapter is one a learner can finish: numbered in order, at most MAX_LINES lines, opening
with what it teaches and what it needs, closing with a summary and exercises, and running top to
bottom on this machine (CPU is enough) within the time and output budgets below."""

import re

import pytest
from conftest import CHAPTERS, output_text

MAX_LINES = 900              # a chapter a learner reads in one sitting
MAX_SECONDS = 90             # a chapter runs in under a minute on a 2-core CPU; 1.5x for a slower CI machine
MAX_OUTPUT_BYTES = 30_000    # what the executed chapter prints and shows as text


def _markdown(path):
    import jupytext

    return [c.source for c in jupytext.read(path).cells if c.cell_type == "markdown"]


def test_chapters_are_numbered_in_order():
    assert [int(p.name[:2]) for p in CHAPTERS] == list(range(1, len(CHAPTERS) + 1))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_has_the_course_shape(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines; the lab log takes what a learner can skip"
    markdown = _markdown(path)
    opening = markdown[0]
    assert opening.startswith("# "), f"{path.name}: the first cell is the chapter's title"
    for heading in ("What you will learn", "What you need first"):
        assert heading in opening, f"{path.name}: its opening cell lacks `{heading}`"
    sections = [m.group(1).strip() for cell in markdown for m in re.finditer(r"^## (.+)$", cell, re.M)]
    assert "Summary" in sections, f"{path.name}: no `## Summary` section"
    assert sections[-1] == "Exercises", f"{path.name}: the last section must be `## Exercises`"


@pytest.mark.slow
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_executes(path, execute_chapter):
    run = execute_chapter(path)
    assert run.error is None, run.error
    assert run.seconds <= MAX_SECONDS, f"{path.name} took {run.seconds:.0f} s on this machine"
    printed = sum(len(output_text(c).encode()) for c in run.notebook.cells if c.cell_type == "code")
    assert printed <= MAX_OUTPUT_BYTES, f"{path.name} shows {printed} bytes of text"
