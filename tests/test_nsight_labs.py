"""The book's Nsight labs page quotes its expected numbers from the committed CSVs: every number of
its tables is a row of ``profiles/results/ncu_targets.csv`` or ``role_timeline.csv``."""

import csv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "book" / "nsight_labs.md"
RESULTS = ROOT / "profiles" / "results"
ROLE_RUNS = [("4f33b5e", "(2, 8) 1x2048"), ("2066b86", "(16, 64) " + "+".join(["4096"] * 8))]


def _rows(name):
    with open(RESULTS / name, newline="") as f:
        return list(csv.DictReader(f))


def missing_quotes(text: str) -> list[str]:
    """The CSV values the page's tables should hold and do not."""
    lines = text.splitlines()
    missing = []
    ncu = _rows("ncu_targets.csv")
    # Lab 1: each kernel's row on (16, 64) 1x32768, the library's stage and FlashQLA
    for r in ncu:
        if r["problem"] == "(16, 64) 1x32768":
            cells = [r["us"], r["dram_mb"], r["dram_pct"], r["tflops"], r["regs"], r["smem_kb"], r["stalls"].split(";")[0]]
            if not any(line.startswith(f"| {r['stage']} |") and all(f"| {c} |" in line for c in cells) for line in lines):
                missing.append(f"{r['stage']} {r['kernel']}: {cells}")
    # Lab 2: each forward's kernels on (2, 8) 1x2048 and their sum
    short = {}
    for r in ncu:
        if r["problem"] == "(2, 8) 1x2048":
            short.setdefault(r["stage"], []).append(r["us"])
    for stage, times in short.items():
        total = f"{sum(map(float, times)):.1f}"
        if not any(x.startswith(f"| {stage}") and x.endswith(f"| {total} |") and all(f" {t}" in x for t in times)
                   for x in lines):
            missing.append(f"{stage} on (2, 8) 1x2048: {times}, sum {total}")
    # Lab 3: each role's span and own time (work + gemm + named barrier), largest wait
    timeline = _rows("role_timeline.csv")
    for commit, problem in ROLE_RUNS:
        run = [r for r in timeline if r["commit"] == commit and r["problem"] == problem and r["impl"] == "API"]
        for role in dict.fromkeys(r["role"] for r in run):
            mine = {r["activity"]: r for r in run if r["role"] == role}
            own = [int(mine[a]["cycles_per_chunk"]) if a in mine else 0 for a in ("work", "gemm", "named barrier")]
            waits = max((r for a, r in mine.items() if a.startswith("wait")), key=lambda r: int(r["cycles_per_chunk"]))
            quote = (f"| {mine['work']['span_cycles_per_chunk']} | {' + '.join(map(str, own))} = {sum(own)} | "
                     f"{waits['activity'].removeprefix('wait ')} {waits['cycles_per_chunk']} |")
            if not any(quote in line for line in lines):
                missing.append(f"{problem} {role}: {quote}")
    return missing


def test_the_labs_quote_the_committed_csvs():
    assert missing_quotes(PAGE.read_text()) == []


@pytest.mark.parametrize("old, new", [("| 800.7 |", "| 801.7 |"), ("| 68.6 |", "| 68.5 |"),
                                      ("1534 + 1194 + 727 = 3455", "1534 + 1194 + 727 = 3456")])
def test_the_check_catches_a_wrong_number(old, new):
    text = PAGE.read_text()
    assert old in text
    assert missing_quotes(text.replace(old, new))


def test_ncu_lab_profiles_a_backward_stage_and_flashqlas_backward():
    """The ncu lab's targets: a stage id gives its op and run (the gdn_bwd stages' runs open their
    NVTX range, e.g. ``gdn_bwd.s03``); ``FlashQLA`` and ``FlashQLA.bwd`` give the peer's forward and
    its backward alone, each inside an NVTX range of its id that ncu's filter names."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncu_lab", ROOT / "profiles" / "ncu_lab.py")
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    op, run = lab.find_target("gdn_bwd.s03")
    assert op == "gdn_bwd" and 'nvtx_range("gdn_bwd.s03")' in Path(run.__code__.co_filename).read_text()
    assert lab.find_target("FlashQLA")[0] == "gdn_fwd" and lab.find_target("FlashQLA.bwd")[0] == "gdn_bwd"
    for stage_id in ("gdn_bwd.s03", "FlashQLA.bwd"):
        assert f"flashqla@{stage_id}/" in lab.ncu_command(stage_id, "log", "16,64,32768")
    assert 'nvtx_range("FlashQLA.bwd")' in (ROOT / "profiles" / "ncu_lab.py").read_text()
