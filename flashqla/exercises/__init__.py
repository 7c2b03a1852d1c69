"""The chapters' exercises: each check runs a learner's answer and says PASS or what is wrong.

A chapter's exercise is four cells, in this order:

    markdown                          the task: what to change, and why
    code, tags ["exercise"]           the learner's starting code: a plausible mistake, with the
                                      line to edit marked ``# TODO``; it runs without raising
    code, tags ["check"]              ``flashqla.exercises.chNN.check_<name>(answer)``, displayed
    code, tags ["solution",           the answer, folded in the book; it ends with
                "hide-input"]         ``result = check_<name>(answer); assert result.passed, result``
                                      and shows ``result``

A check never raises on a wrong answer (the chapter runs top to bottom for a learner who has not
solved it yet): it returns a ``Report``. ``tests/test_exercises.py`` reads the executed chapters
and asserts both ways: every ``check`` cell of a starting answer shows ``not yet``, and every
``solution`` cell shows ``PASS``. The checks compare against the float64 references in
``flashqla.reference`` with the derived tolerance of ``flashqla.testing``, or compile a TileLang
kernel for sm_90a and read the generated CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

PASS = "PASS"
NOT_YET = "not yet"


@dataclass(frozen=True)
class Report:
    """The outcome of one check: ``passed``, and for a wrong answer what is wrong."""

    exercise: str
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        verdict = PASS if self.passed else NOT_YET
        return f"{self.exercise}: {verdict}" + (f": {self.detail}" if self.detail else "")

    __repr__ = __str__

    def _repr_markdown_(self) -> str:  # how a notebook shows it
        verdict = PASS if self.passed else NOT_YET
        return f"**{self.exercise}: {verdict}**" + (f": {self.detail}" if self.detail else "")


def report(exercise: str, failures: list[str]) -> Report:
    """A Report from the list of what is wrong (empty: passed)."""
    return Report(exercise, not failures, "; ".join(failures))


def run_answer(exercise: str, fn, *args, **kwargs):
    """Call a learner's answer; an exception becomes a failure message instead of propagating."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # a learner's code may raise anything; the check reports it
        return None, f"raised {type(exc).__name__}: {exc}"
