"""The lab log (``kernels/lab_log.csv``, ``flashqla.lablog``) lists every stage once, and the book's
Lab log page is what ``python -m flashqla lablog`` writes from it."""

import csv

import pytest

from flashqla import lablog
from flashqla.stages import MILESTONES, discover


def test_every_stage_has_one_row_and_every_row_a_stage():
    rows = [e.stage for e in lablog.read()]
    stages = [s.id for s in discover()]
    assert len(rows) == len(set(rows))
    assert sorted(rows) == sorted(stages), (
        f"no row: {sorted(set(stages) - set(rows))}; no stage: {sorted(set(rows) - set(stages))}")


def test_every_stretch_of_the_path_ends_at_its_milestone():
    """Each row belongs to a milestone's stretch of the path (or comes after an op's last one), and
    every milestone closes a stretch."""
    entries = lablog.read()
    stretches = {lablog.leads_to(e) for e in entries}
    assert stretches - {""} == set(MILESTONES)
    for e in entries:
        if e.verdict == "milestone":
            assert lablog.leads_to(e) == e.stage


def test_the_page_is_the_generated_one():
    assert lablog.PAGE.read_text() == lablog.page(lablog.read(), discover()), (
        "book/lab_log.md is stale: run `python -m flashqla lablog`")


def test_the_page_names_each_milestone_and_its_chapter():
    text = lablog.PAGE.read_text()
    for milestone in MILESTONES:
        assert f"The milestone: `{milestone}`, taught in notebooks/" in text, milestone


def _write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=lablog.COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def _rows():
    with open(lablog.DATA, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("break_it, why", [
    (lambda rows: rows + [rows[0]], "each stage takes one row"),
    (lambda rows: [dict(r, verdict="promoted") if r["stage"] == "gdn_fwd.s07" else r for r in rows], "verdict must be"),
    (lambda rows: [dict(r, verdict="kept") if r["stage"] == "gdn_fwd.s44" else r for r in rows], "`milestone` is for"),
    (lambda rows: [dict(r, verdict="milestone") if r["stage"] == "gdn_fwd.s43" else r for r in rows], "`milestone` is for"),
    (lambda rows: [dict(r, leads_to="gdn_fwd.s33") if r["stage"] == "gate_free_solve.s06" else r for r in rows], "must be a milestone"),
    (lambda rows: [dict(r, leads_to="gdn_fwd.s44") if r["stage"] == "gdn_fwd.s07" else r for r in rows], "only for sub-step ops"),
    (lambda rows: [dict(r, effect=" ") if r["stage"] == "gdn_fwd.s35" else r for r in rows], "empty"),
    (lambda rows: [dict(r, stage="chunk_q.s01") if r["stage"] == "chunk_o.s01" else r for r in rows], "not a stage of an op"),
])
def test_read_catches_a_broken_log(tmp_path, break_it, why):
    path = tmp_path / "lab_log.csv"
    _write(path, break_it(_rows()))
    with pytest.raises(ValueError, match=why):
        lablog.read(path)


def test_the_row_check_catches_a_missing_row(tmp_path):
    path = tmp_path / "lab_log.csv"
    _write(path, [r for r in _rows() if r["stage"] != "gdn_fwd.s38"])
    assert sorted(e.stage for e in lablog.read(path)) != sorted(s.id for s in discover())
