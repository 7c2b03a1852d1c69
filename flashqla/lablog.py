"""The lab log: every stage under ``kernels/``, what it changed, what that measured, and whether it
was kept, grouped by the stretch of the course path it belongs to.

The data is one row a stage in ``kernels/lab_log.csv`` (checked by ``read``); ``python -m flashqla
lablog`` writes the book page ``book/lab_log.md`` from it. Columns:

    stage      the stage id, e.g. ``gate_free_solve.s06``
    leads_to   the milestone (``flashqla.stages.MILESTONES``) whose stretch of the path the stage
               belongs to; given only for the stages of sub-step ops (a gdn_fwd or gdn_bwd stage's
               is the next milestone of its op: ``leads_to``)
    changed    what the stage changed, against the stage it builds on
    effect     its measured effect, quoted from its docstring (``Measured effect``)
    verdict    one of VERDICTS
    why        why it was kept or dropped, or where it lives now
"""

from __future__ import annotations

import ast
import csv
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from flashqla.stages import KERNELS_DIR, MILESTONES, OPS, Stage

DATA = KERNELS_DIR / "lab_log.csv"
PAGE = KERNELS_DIR.parent / "book" / "lab_log.md"
COLUMNS = ("stage", "leads_to", "changed", "effect", "verdict", "why")
VERDICTS = {
    "milestone": "on the course path: a chapter teaches it",
    "baseline": "a peer's code, timed as a row beside ours",
    "kept": "promoted into the library, where it runs now or ran until a later stage replaced it",
    "folded": "not promoted alone; a later stage builds on it",
    "dropped": "measured, and not carried on",
    "pending": "written and checked on the CPU, not yet measured on a GPU",
}
PATH_OPS = ("gdn_fwd", "gdn_bwd")  # the ops whose stages are whole forwards or backwards


@dataclass(frozen=True)
class Entry:
    stage: str
    leads_to: str
    changed: str
    effect: str
    verdict: str
    why: str

    @property
    def op(self) -> str:
        return self.stage.rsplit(".", 1)[0]

    @property
    def number(self) -> int:
        return int(self.stage.rsplit(".s", 1)[1])


def read(path: Path = DATA) -> list[Entry]:
    """The rows of the lab log, checked: the columns, a verdict from VERDICTS, "milestone" exactly
    for the stages in MILESTONES, ``leads_to`` a milestone for the sub-step ops' stages and empty
    for the others, every cell filled but ``leads_to``, each stage once."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: the columns must be {COLUMNS}; got {reader.fieldnames}")
        entries = [Entry(**row) for row in reader]
    seen = Counter(e.stage for e in entries)
    if twice := sorted(s for s, n in seen.items() if n > 1):
        raise ValueError(f"{path}: each stage takes one row; twice: {twice}")
    for e in entries:
        if e.op not in OPS:
            raise ValueError(f"{path}: `{e.stage}` is not a stage of an op in flashqla.stages.OPS")
        if e.verdict not in VERDICTS:
            raise ValueError(f"{path}: {e.stage}'s verdict must be one of {tuple(VERDICTS)}; got {e.verdict!r}")
        if (e.verdict == "milestone") != (e.stage in MILESTONES):
            raise ValueError(f"{path}: {e.stage}: the verdict `milestone` is for the stages in "
                             f"flashqla.stages.MILESTONES, and only for them")
        if e.op in PATH_OPS and e.leads_to:
            raise ValueError(f"{path}: {e.stage}: leads_to is given only for sub-step ops; a "
                             f"{e.op} stage leads to the next milestone of its op")
        if e.op not in PATH_OPS and e.leads_to not in MILESTONES:
            raise ValueError(f"{path}: {e.stage}: leads_to must be a milestone; got {e.leads_to!r}")
        if empty := [c for c in COLUMNS if c != "leads_to" and not getattr(e, c).strip()]:
            raise ValueError(f"{path}: {e.stage}: empty {empty}")
    return entries


def leads_to(entry: Entry) -> str:
    """The milestone whose stretch of the path this stage belongs to ("" past the op's last one):
    a milestone's own, the next milestone of a gdn_fwd or gdn_bwd stage's op, else the row's."""
    if entry.op not in PATH_OPS:
        return entry.leads_to
    later = [m for m in MILESTONES if m.startswith(entry.op + ".") and int(m.rsplit(".s", 1)[1]) >= entry.number]
    return min(later, key=lambda m: int(m.rsplit(".s", 1)[1]), default="")


def taught_in(stage: Stage) -> str:
    """The "Taught in:" line of a stage's docstring (read from its file, nothing imported)."""
    doc = ast.get_docstring(ast.parse(stage.path.read_text())) or ""
    lines = doc.split("Taught in:", 1)[1].split("\n\n", 1)[0].split() if "Taught in:" in doc else []
    return " ".join(lines).rstrip(".")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(entries: list[Entry]) -> list[str]:
    lines = ["| stage | what changed | measured effect | verdict |", "|---|---|---|---|"]
    for e in entries:
        stage = f"**`{e.stage}`**" if e.verdict == "milestone" else f"`{e.stage}`"
        lines.append(f"| {stage} | {_cell(e.changed)} | {_cell(e.effect)} | **{e.verdict}**: {_cell(e.why)} |")
    return lines


def page(entries: list[Entry], stages: list[Stage]) -> str:
    """The Markdown of the book page: a summary, then per op family (the forward, the backward)
    one section per stretch of the path, ending at its milestone: the sub-step ops' stages by op,
    then the family's own."""
    by_id = {s.id: s for s in stages}
    order = {op: i for i, op in enumerate(OPS)}
    out = [
        "# Lab log",
        "",
        f"The course path is {len(MILESTONES)} milestone stages; the chapters teach them one after another. Every "
        "other stage under `kernels/` is an experiment made on the way from one milestone to the "
        "next: frozen, tested on the GPU like the milestones, and listed here with what it changed, "
        "what that measured, and whether it was kept. A learner never needs this page to follow the "
        "chapters; it is where to look when you want to know why the library's kernels are the way "
        "they are, or what was tried and did not pay.",
        "",
        "Verdicts: " + "; ".join(f"**{v}**, {what}" for v, what in VERDICTS.items()) + ".",
        "",
        "Every number is quoted from the stage's docstring (its \"Measured effect\", with the card, "
        "the commit and the problems) or from `profiles/results/`. A ratio of times below 1 is "
        "faster; a ratio of speeds above 1 is. Problems are written (H, HV) N x T: key and value "
        "heads, sequences x tokens, K = V = 128. In a row, a bare sNN is a stage of the same op.",
        "",
        "This page is generated from `kernels/lab_log.csv` by `python -m flashqla lablog`; "
        "`tests/test_lab_log.py` checks that every stage has exactly one row and that the page is "
        "up to date.",
        "",
    ]
    families = []
    for family in PATH_OPS:
        path = [m for m in MILESTONES if m.startswith(family + ".")]
        stretches = []
        for i, milestone in enumerate(path + [""]):
            rows = [e for e in entries if leads_to(e) == milestone
                    and (e.op == family if e.op in PATH_OPS else leads_to(e).startswith(family + "."))]
            if not rows:
                continue
            start = "" if i == 0 else path[i - 1]
            stretches.append((start, milestone, rows))
        families.append((family, stretches))

    out += ["| stretch of the path | stages | kept | folded | dropped |", "|---|---|---|---|---|"]
    for _, stretches in families:
        for start, milestone, rows in stretches:
            count = Counter(e.verdict for e in rows)
            out.append(f"| {_stretch_title(start, milestone)} | {len(rows)} | {count['kept']} | "
                       f"{count['folded']} | {count['dropped']} |")
    out.append("")

    titles = {"gdn_fwd": "The forward", "gdn_bwd": "The backward"}
    for family, stretches in families:
        out += [f"## {titles[family]}", ""]
        for start, milestone, rows in stretches:
            out += [f"### {_stretch_title(start, milestone)}", ""]
            if milestone:
                out += [f"The milestone: `{milestone}`, taught in {taught_in(by_id[milestone])}.", ""]
            else:
                out += [f"Experiments made after the last milestone, `{start}`, the library's; none is on the path.", ""]
            # the sub-step ops' stages by op, in OPS's order, then the family's own, milestone last
            kernels = sorted((e for e in rows if e.op not in PATH_OPS), key=lambda e: (order[e.op], e.number))
            own = sorted((e for e in rows if e.op in PATH_OPS), key=lambda e: (e.verdict == "milestone", e.number))
            if kernels:
                ops = ", ".join(dict.fromkeys(e.op for e in kernels))
                out += [f"#### Sub-step kernels: {ops}", ""] + _table(kernels) + [""]
                out += [f"#### {family} stages", ""]
            out += _table(own) + [""]
    return "\n".join(out)


def _stretch_title(start: str, milestone: str) -> str:
    if not start:
        return f"Up to {milestone}"
    if not milestone:
        return f"After {start}"
    return f"{start} to {milestone}"


def main(path: Path = PAGE) -> int:
    """``python -m flashqla lablog``: write the page; 2 outside a checkout (no kernels/, no book/)."""
    from flashqla.stages import discover

    if not (DATA.exists() and path.parent.is_dir()):
        print(f"python -m flashqla lablog: needs a checkout of the repository ({DATA} and {path.parent}/); "
              "clone it and run `python3 -m pip install -e .` from its root")
        return 2
    path.write_text(page(read(), discover()))
    print(f"wrote {path}")
    return 0
