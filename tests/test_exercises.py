"""Every chapter's exercises are checked both ways, on the chapter as it executed: the learner's
starting answer (a plausible mistake) must fail its check, and the folded solution must pass it.

An exercise is three code cells in a row, tagged ``exercise``, ``check`` and ``solution``
(``flashqla.exercises`` describes the convention).
"""

import pytest
from conftest import CHAPTERS, output_text

from flashqla.exercises import NOT_YET, PASS

ROLES = ("exercise", "check", "solution")


def _exercises(nb):
    """The chapter's exercises as (exercise, check, solution) cell triples, in order."""
    tagged = [(c, role) for c in nb.cells if c.cell_type == "code"
              for role in ROLES if role in c.metadata.get("tags", [])]
    triples = [tagged[i:i + 3] for i in range(0, len(tagged), 3)]
    for triple in triples:
        assert tuple(role for _, role in triple) == ROLES, (
            f"cells tagged {[role for _, role in triple]}: each exercise is an exercise, a check and a "
            "solution cell, in that order")
    return [tuple(c for c, _ in triple) for triple in triples]


@pytest.mark.slow
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_exercises_fail_the_starting_answer_and_pass_the_solution(path, execute_chapter):
    run = execute_chapter(path)
    exercises = _exercises(run.notebook)
    assert 2 <= len(exercises) <= 3, f"{path.name}: {len(exercises)} exercises; a chapter has 2-3"
    for n, (_, check, solution) in enumerate(exercises, 1):
        shown = output_text(check)
        assert NOT_YET in shown and PASS not in shown, (
            f"{path.name}, exercise {n}: the starting answer must fail its check; the check showed {shown!r}")
        shown = output_text(solution)
        assert PASS in shown and NOT_YET not in shown, (
            f"{path.name}, exercise {n}: the solution must pass its check; it showed {shown!r}")


def test_tags_out_of_order_are_refused():
    """The reader above refuses a chapter whose solution comes before its check."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1", metadata={"tags": [role]}) for role in ("exercise", "solution", "check")])
    with pytest.raises(AssertionError, match="in that order"):
        _exercises(nb)
