"""The benchmark's napkin math and its committed results: the README's summary and the book's Results
page are generated from the CSVs; the README is short and its map, links and usage hold; the CSVs
hold what the stages' docstrings quote."""

import dataclasses
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from flashqla import bench
from flashqla.testing import Problem

ROOT = Path(__file__).resolve().parent.parent


def test_useful_flops_per_chunk_and_head():
    # one full chunk, one value head, K = V = 128: 5 products of 64x64x128 and 3 of 64x128x128
    assert bench.useful_flops(Problem(1, 1, (64,))) == 5 * 2 * 64 * 64 * 128 + 3 * 2 * 64 * 128 * 128
    assert bench.useful_flops(Problem(2, 8, (65, 1))) == 3 * 8 * bench.useful_flops(Problem(1, 1, (64,)))


def test_useful_bytes():
    p = Problem(1, 2, (10,), K=4, V=8)
    # q, k: 10x1x4, v, o: 10x2x8 in bf16; g, beta: 10x2 fp32; h0 and final state: 2x4x8 fp32
    assert bench.useful_bytes(p) == 2 * (2 * 40 + 2 * 160) + 4 * 40 + 4 * 2 * 64


def test_a_partial_run_replaces_its_problems_and_keeps_the_others():
    a, b = (p.label for p in bench.PROBLEMS[:2])
    old = [dict(problem=a, impl="x", ms="1"), dict(problem=b, impl="x", ms="2")]
    new = [dict(problem=a, impl="x", ms="3"), dict(problem=a, impl="y", ms="4")]
    assert bench.merge_rows(old, new) == [*new, old[1]]
    assert bench.merge_rows(old[1:], new) == [*new, old[1]]  # in the order of bench.PROBLEMS


def test_a_run_of_some_rows_replaces_only_those():
    a, b = (p.label for p in bench.PROBLEMS[:2])
    old = [dict(problem=a, impl="x", ms="1"), dict(problem=a, impl="z", ms="5"), dict(problem=b, impl="x", ms="2")]
    new = [dict(problem=a, impl="x", ms="3"), dict(problem=a, impl="y", ms="4")]
    assert bench.merge_rows(old, new, rows_timed={"x", "y"}) == [old[1], *new, old[2]]
    assert bench.merge_rows(old, new) == [*new, old[2]]  # a whole run drops the rows it no longer has


def test_readme_summary_is_regenerated_from_the_committed_csvs():
    """The README's table is ``bench.summary_table`` of the committed CSVs; a changed time shows."""
    runs = {name: bench.read_csv(bench.RESULTS / f"{name}.csv") for name in bench.MODES}
    block = bench.between(bench.README.read_text(), "summary")
    assert block == bench.summary_table(runs), "README results are stale: run `python -m flashqla bench --report`"
    api = next(r for r in runs["gdn_fwd"] if r["impl"] == bench.API_ROW)
    api["ms"] = str(float(api["ms"]) * 1.5)
    assert bench.summary_table(runs) != block


@pytest.mark.parametrize("mode", bench.MODES.values(), ids=lambda m: m.name)
def test_results_page_is_regenerated_from_the_committed_csv(mode):
    rows = bench.read_csv(bench.RESULTS / f"{mode.name}.csv")
    block = bench.between(bench.RESULTS_PAGE.read_text(), mode.name)
    assert block == bench.results_table(rows, mode), \
        "book/results.md is stale: run `python -m flashqla bench --report`"
    changed = [dict(r) for r in rows]
    next(r for r in changed if r["impl"] == mode.peers[1])["method"] = "CUDA events, no graph (capture failed)"
    assert bench.results_table(changed, mode) != block
    for r in rows:  # provenance on every row
        assert all(r[c] for c in ("gpu", "driver", "cuda", "torch", "tilelang", "fla", "flash_qla",
                                  "commit", "date", "method")), r
    # the book shows the plot that --report drew
    assert (bench.PLOTS / f"{mode.name}.png").read_bytes() == (bench.RESULTS / f"{mode.name}.png").read_bytes()
    assert f"images/{mode.name}.png" in bench.RESULTS_PAGE.read_text()


def test_cp_page_is_regenerated_from_the_committed_csv():
    """book/cp.md's scaling table is ``bench.cp_table`` of results/cp.csv, with provenance on every
    row; a changed time shows; the page shows the plot that --report drew."""
    rows = bench.read_csv(bench.RESULTS / "cp.csv")
    block = bench.between(bench.CP_PAGE.read_text(), "cp")
    assert block == bench.cp_table(rows), "book/cp.md is stale: run `python -m flashqla bench --report`"
    changed = [dict(r) for r in rows]
    next(r for r in changed if r["ms"])["ms"] = "99.0"
    assert bench.cp_table(changed) != block
    for r in rows:
        assert all(r[c] for c in ("gpu", "driver", "cuda", "torch", "tilelang", "fla", "flash_qla",
                                  "commit", "date", "method")), r
    assert (bench.PLOTS / "cp.png").read_bytes() == (bench.RESULTS / "cp.png").read_bytes()
    assert "images/cp.png" in bench.CP_PAGE.read_text()


def test_ratios_come_from_one_run():
    """The API's ratio to a peer is computed from rows of one run; a peer row from another commit
    or card raises, and so does a problem without an API time."""
    rows = [dict(problem="(2, 8) 1x2048", impl=name, ms=ms, commit="abc", gpu="H100")
            for name, ms in ((bench.FLA_ROW, "0.3"), (bench.FLASHQLA_ROW, "0.2"), (bench.API_ROW, "0.1"))]
    assert bench.api_ratios(rows) == {"(2, 8) 1x2048": pytest.approx((3.0, 2.0))}
    rows[1]["commit"] = "def"
    with pytest.raises(ValueError, match="not from one run"):
        bench.api_ratios(rows)
    rows[1]["commit"], rows[2]["ms"] = "abc", ""
    with pytest.raises(ValueError, match="no time for"):
        bench.api_ratios(rows)


def test_plots_draw_the_peers_the_api_and_the_milestones_only():
    from flashqla.stages import MILESTONES

    for mode in bench.MODES.values():
        rows = bench.read_csv(bench.RESULTS / f"{mode.name}.csv")
        series = bench.plot_series(rows, mode)
        stages = [i for i in series if i not in (*mode.peers, bench.API_ROW)]
        assert set(series) >= {*mode.peers, bench.API_ROW} and stages
        assert all(bench.stage_id(i).removeprefix("fwd + ") in MILESTONES for i in stages), stages
        styles = [style[1:] for style in series.values()]
        assert len(set(c for c, _ in styles)) == len(styles) == len(set(m for _, m in styles))


def test_readme_is_at_most_12_kib():
    assert bench.README.stat().st_size <= 12 * 1024, bench.README.stat().st_size


def _readme_section(title, text=None):
    text = text or bench.README.read_text()
    start = text.index(f"\n## {title}\n")
    return text[start:text.find("\n## ", start + 1)]


def _map_misfits(text, root, tracked):
    """What the README's Map gets wrong about the tree: paths it names that do not exist, top-level
    entries (of ``tracked``, the files git knows) and library modules it does not name."""
    import re

    named = set()
    for row in _readme_section("Map", text).splitlines():
        if row.startswith("| `"):
            named.update(re.findall(r"`([^`]+)`", row.split(" | ")[0]))
    wrong = [f"names {p}, not in the tree" for p in sorted(named) if not (root / p.split("<")[0]).exists()]
    top = {f.split("/")[0] for f in tracked} - {"README.md"}
    listed = {p.split("/")[0] for p in named}
    modules = {f"flashqla/{p.name}" + ("/" if p.is_dir() else "") for p in (root / "flashqla").iterdir()
               if p.suffix == ".py" and p.name != "__init__.py" or p.is_dir() and (p / "__init__.py").exists()}
    return wrong + [f"misses {p}" for p in sorted(top - listed) + sorted(modules - named)]


def test_readme_map_matches_the_tree():
    """Every path the Map names exists, and it names every top-level entry of the tree and every
    module of the library; a map with a row dropped or a path misspelt fails."""
    import subprocess

    root = bench.README.parent
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if tracked.returncode:
        pytest.skip("not a git checkout")
    tracked = tracked.stdout.splitlines()
    text = bench.README.read_text()
    assert _map_misfits(text, root, tracked) == []
    broken = text.replace("| `.gitignore` |", "| |").replace("`flashqla/timing.py`", "`flashqla/timings.py`")
    assert _map_misfits(broken, root, tracked) == [
        "names flashqla/timings.py, not in the tree", "misses .gitignore", "misses flashqla/timing.py"]


def _dead_links(text, root):
    """Local links of ``text`` that lead nowhere, and chapters of the tree it does not link."""
    import re

    local = [x for x in re.findall(r"\]\(([^)#]+)\)", text) if not x.startswith("http")]
    chapters = {f"notebooks/{p.name}" for p in (root / "notebooks").glob("[0-9][0-9]_*.py")}
    return [x for x in local if not (root / x).exists()] + sorted(chapters - set(local))


def test_readme_links_resolve():
    root = bench.README.parent
    text = bench.README.read_text()
    assert "](book/results.md)" in text and _dead_links(text, root) == []
    broken = text.replace("](notebooks/01_recurrence.py)", "](notebooks/01_recurence.py)")
    assert _dead_links(broken, root) == ["notebooks/01_recurence.py", "notebooks/01_recurrence.py"]


def test_readme_usage_runs_on_cpu():
    """The usage block, on the CPU (the reference): the shapes it promises."""
    import re
    import warnings

    code = re.search(r"```python\n(.*?)```", _readme_section("Usage"), re.S).group(1)
    scope = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time warning: the reference runs on the CPU
        exec(code.replace('device="cuda"', 'device="cpu"'), scope)
    assert scope["o"].shape == scope["v"].shape and scope["ht"].shape == scope["h0"].shape
    assert torch.isfinite(scope["o"].float()).all()


def test_bench_from_an_installed_wheel_says_it_needs_a_checkout(monkeypatch, tmp_path, capsys):
    from flashqla import __main__ as cli

    monkeypatch.setattr(bench, "RESULTS", tmp_path / "profiles" / "results")  # as next to a wheel
    for argv in (["bench", "--report"], ["bench"]):
        assert cli.main(argv) == 2
        assert "needs a checkout of the repository" in capsys.readouterr().err


def test_ncu_roofline_redraws_from_the_committed_csvs(tmp_path):
    import subprocess
    import sys

    csvs = sorted(str(p) for p in bench.RESULTS.glob("ncu_*.csv"))
    assert csvs, "no committed Nsight Compute summaries under profiles/results"
    out = tmp_path / "roofline.png"
    subprocess.run([sys.executable, str(bench.RESULTS.parent / "ncu_lab.py"), "report", *csvs, str(out)],
                   check=True, capture_output=True)
    assert out.stat().st_size > 10_000


def test_a_lost_device_stops_the_run_and_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the row failed, the device is fine
    assert bench._stop_if_device_lost("FLA", "(2, 8) 1x2048") is None

    def lost():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    with pytest.raises(RuntimeError, match=r"context is lost after `FLA` on \(2, 8\) 1x2048.*--heads"):
        bench._stop_if_device_lost("FLA", "(2, 8) 1x2048")


def test_a_peer_that_fails_once_is_timed_once_more(monkeypatch):
    """A peer's row that raises (FLA's Triton compile on a fresh machine) is timed a second time; a
    second failure, or a lost device, is raised."""
    import torch

    calls = []

    def flaky(fn, sets, grad=False):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("PassManager::run failed")
        return 0.1, "CUDA graph replay"

    monkeypatch.setattr(bench, "time_row", flaky)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert bench.time_peer_twice(None, []) == (0.1, "CUDA graph replay") and len(calls) == 2

    def broken(fn, sets, grad=False):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(bench, "time_row", broken)
    with pytest.raises(RuntimeError, match="PassManager"):
        bench.time_peer_twice(None, [])

    def lost():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    calls.clear()
    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bench.time_peer_twice(None, [])
    assert len(calls) == 1


def test_heads_and_lengths_reads_every_problem_label():
    for p in bench.PROBLEMS + list(bench.TRAINING.problems):
        assert bench.heads_and_lengths(p.label) == (p.H, p.HV, list(p.lengths)), p.label
    with pytest.raises(ValueError, match="label"):
        bench.heads_and_lengths("16, 32 4096")


def test_input_sets_share_one_cu_seqlens(monkeypatch):
    """Every input set of a problem holds the same ``cu_seqlens`` tensor (the peers memoize by its
    identity, 4 entries deep); the other inputs are the set's own. The bench's problems: some have
    more than 4 sets (an H200's 60 MB of L2 as example)."""
    monkeypatch.setattr(bench, "problem_inputs", lambda problem, seed, training=False: problem.inputs("cpu", seed))
    p = Problem(2, 8, (300, 77))
    sets = bench.input_sets(p, bench.useful_bytes(p) * 5 // 2)
    assert len(sets) == 5
    assert all(x["cu_seqlens"] is sets[0]["cu_seqlens"] for x in sets)
    assert not torch.equal(sets[0]["v"], sets[1]["v"])
    assert max(bench.num_input_sets(p, 60 * 2**20) for p in bench.PROBLEMS) > 4


def _prologue_times(name):
    import csv

    with open(bench.RESULTS / name, newline="") as f:
        rows = list(csv.DictReader(f))
    times = {}
    for r in rows:
        times.setdefault(r["problem"], {})[r["kernel"]] = float(r["us"])
    return times


def _solve_time(label, times, heads_per_cta):
    """The time of the solve kernel a rule ``heads_per_cta(H, HV, chunks) -> R`` runs on a problem
    (s08 at one or two heads a CTA, s06 at three or four: gate_free_solve.s09's kernel choice)."""
    H, HV, lengths = bench.heads_and_lengths(label)
    R = heads_per_cta(H, HV, -(-sum(lengths) // 64))
    return times[f"gate_free_solve.{'s08' if R <= 2 else 's06'}/{R}"]


@pytest.mark.parametrize("results, rule, fails", [
    ("prologue.csv", "s10", False), ("prologue.csv", "s09", True),
    ("solve_in_forward.csv", "s11", False), ("solve_in_forward.csv", "s10", True)])
def test_solve_heads_per_cta_is_the_fastest_measured(results, rule, fails):
    """Each kernel alone (``results/prologue.csv``, profiles/prologue_lab.py measure):
    gate_free_solve.s10's heads a CTA (from the grid) run a solve within 5 % of the fastest grouping
    on every problem; s09's (from the heads alone) do not: 1.65x on (2, 8) 1x2048. Inside the
    forward (``results/solve_in_forward.csv``, prologue_lab.py forward): s11's are within 5 %; s10's
    are not: 1.60x on (2, 8) 1x8192. The cumsum alone: s02 faster than s01 on every problem."""
    from flashqla.stages import load

    pick = {"s11": lambda H, HV, chunks: load("gate_free_solve", 11).heads_per_cta(H, HV, chunks, 132),
            "s10": lambda H, HV, chunks: load("gate_free_solve", 10).heads_per_cta(H, HV, chunks, 132),
            "s09": lambda H, HV, chunks: load("gate_free_solve", 9).cta_heads(H, HV)}[rule]
    times = _prologue_times(results)
    assert len(times) == 16
    worst = max(_solve_time(label, t, pick) / min(v for k, v in t.items() if k.startswith("gate_free_solve"))
                for label, t in times.items())
    assert (worst > 1.05) == fails, worst
    if results == "prologue.csv":
        assert all(t["chunk_local_cumsum.s02"] < t["chunk_local_cumsum.s01"] for t in times.values())


def test_prologue_lab_reports_the_committed_csv():
    import subprocess

    out = subprocess.run([sys.executable, str(bench.RESULTS.parent / "prologue_lab.py"), "report",
                          str(bench.RESULTS / "prologue.csv")], capture_output=True, text=True, check=True).stdout
    assert out.count("\n") == 16 and "(2, 8) 1x2048" in out and "solve s08/2   6.2" in out


def test_timeline_lab_reports_the_committed_csv():
    """``results/timeline.csv`` (profiles/timeline_lab.py) prints as 24 timelines, and holds what
    gdn_fwd.s27's and s28's docstrings quote: on (8, 32) 1x2048 the API's fused kernel level with
    FlashQLA's and its solve (four heads a CTA) 6-7 us slower."""
    import csv
    import subprocess

    path = bench.RESULTS / "timeline.csv"
    out = subprocess.run([sys.executable, str(bench.RESULTS.parent / "timeline_lab.py"), "report", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("== ") == 24
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["problem"] == "(8, 32) 1x2048"]

    def us(impl, part):
        (hit,) = [float(r["us"]) for r in rows if r["impl"] == impl and part in r["kernel"]]
        return hit

    assert us("API", "solve") == 24.3 and us("FlashQLA", "solve") == 17.6
    assert abs(us("API", "fused") - us("FlashQLA", "fused")) < 2


def test_weak_rows_timeline_holds_what_the_stages_quote():
    """``results/timeline_weak_rows.csv`` (timeline_lab.py, 2066b86) prints as ten timelines and holds
    what gdn_fwd.s42's and s43's docstrings quote: the solve 146.3 of the API's 364.0
    us on (16, 16) 8x4096 against FlashQLA's kkt_solve 113.6, and 400.0 of 1150.6 on (16, 64)
    8x4096; the lab's ``--problems`` names exactly those five problems."""
    import subprocess

    sys.path.insert(0, str(bench.RESULTS.parent))
    try:
        import timeline_lab
    finally:
        sys.path.pop(0)
    path = bench.RESULTS / "timeline_weak_rows.csv"
    out = subprocess.run([sys.executable, str(bench.RESULTS.parent / "timeline_lab.py"), "report", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("== ") == 10
    rows = bench.read_csv(path)
    labels = list(dict.fromkeys(r["problem"] for r in rows))
    assert [p.label for p in timeline_lab.problems([bench.short_label(x) for x in labels])] == labels

    def us(label, impl, part):
        (hit,) = [(float(r["us"]), float(r["span_us"])) for r in rows
                  if bench.short_label(r["problem"]) == label and r["impl"] == impl and part in r["kernel"]]
        return hit

    assert us("(16, 16) 8x4096", "API", "solve") == (146.3, 364.0)
    assert us("(16, 16) 8x4096", "FlashQLA", "kkt_solve")[0] == 113.6
    assert us("(16, 64) 8x4096", "API", "solve") == (400.0, 1150.6)
    with pytest.raises(ValueError, match="not benchmark problems"):
        timeline_lab.problems(["(3, 9) 1x5"])


def test_prologue_timeline_holds_what_the_stages_quote():
    """``results/timeline_prologue.csv`` (profiles/timeline_lab.py, gdn_fwd.s31, s30, the API = s29,
    FlashQLA) prints as 24 timelines, and holds what gate_free_solve.s13's and s12's docstrings quote:
    on (2, 8) 1x2048 s31's one kernel 8.4 us where s30's cumsum and solve took 2.1 + 8.9; on (8, 24)
    1x2048 s30's solve at six CTAs an SM 15.6 against the API's 20.4."""
    import csv
    import subprocess

    path = bench.RESULTS / "timeline_prologue.csv"
    out = subprocess.run([sys.executable, str(bench.RESULTS.parent / "timeline_lab.py"), "report", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("== ") == 24
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))

    def us(problem, impl, part):
        (hit,) = [float(r["us"]) for r in rows if r["problem"] == problem and r["impl"] == impl and part in r["kernel"]]
        return hit

    assert us("(2, 8) 1x2048", "gdn_fwd.31", "solve_with_cumsum") == 8.4
    assert (us("(2, 8) 1x2048", "gdn_fwd.30", "cumsum"), us("(2, 8) 1x2048", "gdn_fwd.30", "solve")) == (2.1, 8.9)
    assert (us("(8, 24) 1x2048", "gdn_fwd.30", "solve"), us("(8, 24) 1x2048", "API", "solve")) == (15.6, 20.4)


def _role_timeline_lab():
    sys.path.insert(0, str(bench.RESULTS.parent))
    try:
        import role_timeline_lab
    finally:
        sys.path.pop(0)
    return role_timeline_lab


FAKE_KERNEL = """extern "C" __global__ void __launch_bounds__(512, 1) k(float* ht, int num_seqs) {
  if (((int)threadIdx.x) < 128) {
    for (int c = 0; c < 4; ++c) {
      bar_a[0].wait((c & 1));
      tl::__sync_thread_partial(3, 128);
      {
        tl::warpgroup_arrive();
        tl::warpgroup_commit_batch();
        tl::warpgroup_wait<0>();
      }
      bar_b[0].arrive();
    }
  }
}
"""


def test_role_timeline_lab_stamps_every_wait_sync_gemm_and_arrive():
    """profiles/role_timeline_lab.py: a stamp before and after each mbarrier wait and named barrier,
    around each wgmma batch, after each arrive, and the clock and timer stamps first and last."""
    lab = _role_timeline_lab()
    code, sites = lab.instrument(FAKE_KERNEL, state_elems=16, cap=100)
    assert sites == [("wait", "bar_a"), ("done", "bar_a"), ("sync", "named barrier"), ("done", "named barrier"),
                     ("gemm", "gemm"), ("done", "gemm"), ("arrive", "bar_b")]
    body = code.split("\n")
    at = {s.strip(): i for i, s in enumerate(body)}
    assert at["FQ_STAMP(0);"] + 1 == at["bar_a[0].wait((c & 1));"] == at["FQ_STAMP(1);"] - 1
    assert at["FQ_STAMP(4);"] + 1 == at["tl::warpgroup_arrive();"]
    assert at["tl::warpgroup_wait<0>();"] + 1 == at["FQ_STAMP(5);"]
    assert at["bar_b[0].arrive();"] + 1 == at["FQ_STAMP(6);"]
    last = [s.strip() for s in body if s.strip()][-3:]
    assert last == [f"FQ_STAMP_ANY({lab.CLOCK_SITE}, clock64());", f"FQ_STAMP_ANY({lab.TIMER_SITE}, fq_globaltimer());",
                    "}"]
    with pytest.raises(ValueError, match="__launch_bounds__"):
        lab.instrument("__global__ void k() {}", 16, 100)


def test_role_timeline_lab_attributes_each_interval_to_its_first_stamp():
    lab = _role_timeline_lab()
    sites = [("wait", "bar_a"), ("done", "bar_a"), ("gemm", "gemm"), ("done", "gemm"), ("arrive", "bar_b")]
    word = lambda site, t: site << lab.SITE_BITS | t
    words = [word(lab.TIMER_SITE, 5000), word(lab.CLOCK_SITE, 100), word(0, 110), word(1, 150), word(2, 160),
             word(3, 200), word(4, 205), word(lab.CLOCK_SITE, 230), word(lab.TIMER_SITE, 5065), 0, 0]
    spent, span, ns, events = lab.activities(torch.tensor(words, dtype=torch.uint64).view(torch.int64).tolist(), sites)
    # work: 100-110, 150-160 (after the wait ended), 200-205, 205-230 (after the arrive)
    assert spent == {"work": 10 + 10 + 5 + 25, "wait bar_a": 40, "gemm": 40}
    assert (span, ns, len(events)) == (130, 65, 5)
    with pytest.raises(AssertionError, match="cap"):
        lab.activities(words[:-4], sites)


def test_role_timeline_holds_what_the_stages_quote():
    """``results/role_timeline.csv`` (profiles/role_timeline_lab.py) prints per role, and holds what
    gdn_fwd.s34's to s40's docstrings quote on (16, 64) 1x8192: the wide kernel's scores / output
    warpgroup waits under 12 % of its span in the library's and s34's kernels; s34's own work there
    3735 cycles a chunk against 3873; s35's value warpgroup 6635 against s34's 2252; s37's state span
    5847, its value warpgroup's work 2242; the chain of s39 4885 (work 2510) and of s40 4835 (2461); s41's scores warpgroup 5157 (3069).
    At BV 128 (the library at 2066b86, (16, 16) 8x4096) the scores / output warpgroup's own work is
    over half its span, where the state warpgroup waits over half of its on Vd.
    On (2, 8) 1x2048 at BV 16 (4f33b5e), what gdn_fwd.s45's docstring quotes: the library's chain
    spends 3455 cycles a chunk on its own (work, wgmma, named barriers), s45's 2782, and waits 2461
    for w; s45's scores warpgroup works 4352 cycles a chunk against the library's 2872."""
    import csv
    import subprocess

    path = bench.RESULTS / "role_timeline.csv"
    out = subprocess.run([sys.executable, str(bench.RESULTS.parent / "role_timeline_lab.py"), "report", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert out.count("cycles per chunk") == 15
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["problem"] == "(16, 64) 1x8192"]

    def cycles(impl, role, activity):
        (hit,) = [int(r["cycles_per_chunk"]) for r in rows if (r["impl"], r["role"], r["activity"]) == (impl, role, activity)]
        return hit

    for impl in ("API", "gdn_fwd.s34"):
        assert sum(float(r["share"]) for r in rows
                   if (r["impl"], r["role"]) == (impl, "scores/output") and r["activity"].startswith("wait")) < 0.12
    assert (cycles("gdn_fwd.s34", "scores/output", "work"), cycles("API", "scores/output", "work")) == (3735, 3873)
    assert (cycles("gdn_fwd.s35", "value", "work"), cycles("gdn_fwd.s34", "value", "work")) == (6635, 2252)
    span = {(r["impl"], r["role"]): int(r["span_cycles_per_chunk"]) for r in rows}
    assert (span["gdn_fwd.s37", "state"], cycles("gdn_fwd.s37", "value", "work")) == (5847, 2242)
    assert (span["gdn_fwd.s39", "chain"], cycles("gdn_fwd.s39", "chain", "work")) == (4885, 2510)
    assert (span["gdn_fwd.s40", "chain"], cycles("gdn_fwd.s40", "chain", "work")) == (4835, 2461)
    assert (span["gdn_fwd.s41", "scores"], cycles("gdn_fwd.s41", "scores", "work")) == (5157, 3069)
    with open(path, newline="") as f:
        wide = {(r["role"], r["activity"]): float(r["share"]) for r in csv.DictReader(f)
                if r["problem"].startswith("(16, 16) 4096+") and r["commit"] == "2066b86"}
    assert wide["scores/output", "work"] > 0.5 and wide["state", "wait bar_vd_ready"] > 0.5
    with open(path, newline="") as f:
        short = {(r["impl"], r["role"], r["activity"]): int(r["cycles_per_chunk"]) for r in csv.DictReader(f)
                 if r["problem"] == "(2, 8) 1x2048" and r["commit"] == "4f33b5e"}
    own = lambda impl: sum(short[impl, "chain", a] for a in ("work", "gemm", "named barrier"))  # noqa: E731
    assert (own("API"), own("gdn_fwd.s45"), short["gdn_fwd.s45", "chain", "wait bar_w_ready"]) == (3455, 2782, 2461)
    assert (short["API", "scores", "work"], short["gdn_fwd.s45", "scores", "work"]) == (2872, 4352)


def test_solve_kernels_hold_what_the_stages_quote():
    """``results/solve_kernels.csv`` (profiles/solve_lab.py --kernels) holds what gate_free_solve.s15's
    and s16's docstrings quote: every new kernel faster than the one it replaces, s15 at 0.68-0.81x
    s06's time, s16 at 0.77-0.92x s14's, Ab within 3.0e-4 (s15) and 5.2e-4 (s16) of theirs."""
    rows = bench.read_csv(bench.RESULTS / "solve_kernels.csv")
    ratio = {}
    for r in rows:
        ratio.setdefault(r["after"][:3], []).append(float(r["after_us"]) / float(r["before_us"]))
        assert float(r["rel_l2"]) <= {"s15": 3.0e-4, "s16": 5.2e-4}[r["after"][:3]], r
    assert (round(min(ratio["s15"]), 2), round(max(ratio["s15"]), 2)) == (0.68, 0.81)
    assert (round(min(ratio["s16"]), 2), round(max(ratio["s16"]), 2)) == (0.77, 0.92)
    assert len(rows) == 13 and {r["commit"] for r in rows} == {"69c6bf5"}


def test_warmup_two_products_holds_what_s44_quotes():
    """``results/warmup_two_products.csv`` holds gdn_fwd.s44's table (s43 and s44 at the same rule,
    one process, cd21a8d): each split problem 0.78-0.85x s43's time; and the run at fbf3c07 (the
    library = s44) holds what s44's docstring quotes: at least FlashQLA's speed on all 40 problems,
    1.05-2.06x (geomean 1.33x), 1.39-4.21x FLA's (geomean 2.74x), (16, 64) 1x32768 at 2.22x the
    floor."""
    from flashqla.stages import load

    two = {}
    for r in bench.read_csv(bench.RESULTS / "warmup_two_products.csv"):
        two.setdefault(r["problem"], {})[r["impl"]] = float(r["ms"])
    ratios = [t["gdn_fwd.s44"] / t["gdn_fwd.s43"] for t in two.values()]
    assert len(two) == 12 and (round(min(ratios), 2), round(max(ratios), 2)) == (0.78, 0.85)
    doc = load("gdn_fwd", 44).__doc__
    for label, t in two.items():
        assert f"{bench.short_label(label):20s}{t['gdn_fwd.s43']:6.4f}   {t['gdn_fwd.s44']:6.4f}" in doc, label
    run = {}  # the fbf3c07 run: rows a later run replaced are in gdn_fwd_earlier_runs.csv
    for name in ("gdn_fwd.csv", "gdn_fwd_earlier_runs.csv"):
        for r in bench.read_csv(bench.RESULTS / name):
            if r["commit"] == "fbf3c07":
                run.setdefault(r["problem"], {})[r["impl"]] = r
    vs_q = [float(t[bench.FLASHQLA_ROW]["ms"]) / float(t[bench.API_ROW]["ms"]) for t in run.values()]
    vs_f = [float(t[bench.FLA_ROW]["ms"]) / float(t[bench.API_ROW]["ms"]) for t in run.values()]
    geo = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    assert len(run) == 40 and min(vs_q) >= 1.0
    assert [round(x, 2) for x in (min(vs_q), max(vs_q), geo(vs_q))] == [1.05, 2.06, 1.33]
    assert [round(x, 2) for x in (min(vs_f), max(vs_f), geo(vs_f))] == [1.39, 4.21, 2.74]
    assert run["(16, 64) 1x32768"][bench.API_ROW]["x_floor"] == "2.22"


def test_ncu_targets_hold_the_quoted_kernel_times():
    """``results/ncu_targets.csv`` (one H100, ae1f15b) holds the numbers quoted from it:
    - on (16, 64) 1x32768, the fused kernel's 378 GFLOP equal the benchmark's useful FLOPs, at 60 %
      of the run's GEMM roof, and the solve's 309 us for 423 MB;
    - on (2, 8) 1x2048, the three forwards' kernel sums, 68.6, 78.0 and 100.6 us."""
    from flashqla.testing import Problem

    rows = bench.read_csv(bench.RESULTS / "ncu_targets.csv")
    assert {r["commit"] for r in rows} == {"ae1f15b"} and {r["gpu"] for r in rows} == {"NVIDIA H100 80GB HBM3"}
    long = Problem(16, 64, (32768,))
    fused, = (r for r in rows if r["stage"] == "gdn_fwd.s44" and r["problem"] == long.label and "fused" in r["kernel"])
    solve, = (r for r in rows if r["stage"] == "gdn_fwd.s44" and r["problem"] == long.label and "solve" in r["kernel"])
    assert abs(float(fused["gflop"]) * 1e9 / bench.useful_flops(long) - 1) < 0.01
    assert round(float(fused["tflops"]) / float(fused["bf16_roof_tflops"]), 2) == 0.60
    assert (fused["us"], solve["us"], solve["dram_mb"], solve["dram_pct"]) == ("800.7", "309.15", "423.41", "40.9")
    sums = {}
    for r in rows:
        if r["problem"] == "(2, 8) 1x2048":
            sums[r["stage"]] = sums.get(r["stage"], 0) + float(r["us"])
    assert {k: round(v, 1) for k, v in sums.items()} == {"gdn_fwd.s44": 68.6, "FlashQLA": 78.0, "gdn_fwd.s00": 100.6}


def test_chain_on_w_holds_what_s45_quotes():
    """``results/chain_on_w.csv`` holds gdn_fwd.s45's table: s44 against s45's first build (635e334)
    and against this one (5e4296f), each pair from one process; the narrow kernel is slower in
    both (1.67-1.78x and 1.28-1.31x s44's time), and (16, 64) 1x2048, which runs BV 64, is even."""
    from flashqla.stages import load

    runs = {}
    for r in bench.read_csv(bench.RESULTS / "chain_on_w.csv"):
        runs.setdefault(r["commit"], {}).setdefault(r["problem"], {})[r["impl"]] = float(r["ms"])
    doc = load("gdn_fwd", 45).__doc__
    for commit, build in (("635e334", "first"), ("5e4296f", "this one")):
        ratios = {}
        for label, t in runs[commit].items():
            ratio = t["gdn_fwd.s45"] / t["gdn_fwd.s44"]
            ratios[label] = ratio
            line = f"{bench.short_label(label):18s}{t['gdn_fwd.s44']:6.4f}   {t['gdn_fwd.s45']:6.4f}   {ratio:4.2f}   {build}, {commit}"
            assert line in doc, line
        narrow = [v for k, v in ratios.items() if not k.startswith("(16, 64)")]
        assert min(narrow) > 1.25
    assert abs(runs["635e334"]["(16, 64) 1x2048"]["gdn_fwd.s45"] / runs["635e334"]["(16, 64) 1x2048"]["gdn_fwd.s44"] - 1) < 0.01
    this = [t["gdn_fwd.s45"] / t["gdn_fwd.s44"] for t in runs["5e4296f"].values()]
    assert len(this) == 6 and (round(min(this), 2), round(max(this), 2)) == (1.28, 1.31)


def test_cp_rows_reach_the_csv_as_they_come(tmp_path):
    """bench cp: each rank-0 row appended to the JSON lines rewrites the CSV from all of them, with
    FLA's ratio (same world size) and the strong-scaling efficiency (same impl on one GPU)."""
    import csv
    import json

    out, path = tmp_path / "cp.rows.jsonl", tmp_path / "cp.csv"
    meta = {"gpu": "test", "commit": "abc", "gemm_roof_tflops": 800}
    p = bench.CP_PROBLEMS[0].label
    rows = [dict(problem=p, impl=bench.API_ROW, step="forward", world_size=1, ms=2.0, exchange_ms=""),
            dict(problem=p, impl="FLA", step="forward", world_size=1, ms=8.0, exchange_ms=""),
            dict(problem=p, impl=bench.API_ROW, step="forward", world_size=2, ms=1.25, exchange_ms=0.25)]
    for n, row in enumerate(rows, 1):
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        bench._write_cp_csv(str(out), path, meta)
        written = list(csv.DictReader(open(path)))
        assert len(written) == n and written[-1]["commit"] == "abc"
    api1, fla1, api2 = written
    assert float(api1["vs_fla"]) == 4.0 and float(api1["efficiency"]) == 1.0
    assert float(api2["efficiency"]) == 0.8 and float(api2["exchange_share"]) == 0.2
    assert api2["vs_fla"] == ""  # FLA not timed on two GPUs in this run


def test_training_has_one_odd_varlen_mix_per_layout():
    """One training problem per head layout packs sequences of lengths that are no multiple of the
    64-token chunk, among them one shorter than a chunk and one over 8192; the forward has no such
    problem; its label reads back."""
    odd = [p for p in bench.TRAINING.problems if all(n % bench.CHUNK for n in p.lengths)]
    assert [(p.H, p.HV) for p in odd] == list(bench.PUBLIC_HEADS)
    for p in odd:
        assert min(p.lengths) < bench.CHUNK < 8192 < max(p.lengths) and len(p.lengths) > 2
        assert bench.short_label(p.label) == f"({p.H}, {p.HV}) " + "+".join(map(str, p.lengths))
        assert bench.heads_and_lengths(p.label) == (p.H, p.HV, list(p.lengths))
    assert not [p for p in bench.PROBLEMS if all(n % bench.CHUNK for n in p.lengths)]


def test_summary_counts_problems_a_layout_when_some_are_untimed():
    """A run that timed the odd mix on one layout only: the README's summary says 3-4 problems."""
    runs = {name: bench.read_csv(bench.RESULTS / f"{name}.csv") for name in bench.MODES}
    odd = {p.label for p in bench.TRAINING.problems if p.lengths == bench.ODD_MIX}
    three = [r for r in runs["gdn_train"] if r["problem"] not in odd]
    one = [dict(r, problem=f"(2, 8) {'+'.join(map(str, bench.ODD_MIX))}") for r in three
           if r["problem"] == "(2, 8) 1x8192"]
    head = "Training step (forward + backward): {} problems a layout ("
    assert head.format(3) in bench.summary_table({**runs, "gdn_train": three})
    assert head.format("3-4") in bench.summary_table({**runs, "gdn_train": three + one})


def _cpu_training_inputs():
    """A small varlen training problem on the CPU in float32 (the API runs the reference there),
    with its upstream gradients do and dht."""
    from flashqla.testing import cast_floats

    x = Problem(1, 2, (40, 25), K=16, V=16).inputs("cpu", seed=3)
    return cast_floats(bench._with_upstream_grads(x, 3), torch.float32)


def test_the_api_rows_backward_is_the_steps_gradients_from_one_forward(monkeypatch):
    """The API's training row on the CPU: ``backward(x)`` runs the forward once and returns a call
    that gives the step's gradients, equal, every time it is called (the timing replays it); the
    step runs a forward each call. Without ``retain_graph`` the second call raises; a backward
    that ran the forward inside the call would count more forwards; other gradients differ."""
    import warnings

    from flashqla import api

    forwards = []
    real = api.chunk_gated_delta_rule

    def counted(**kw):
        forwards.append(1)
        return real(**kw)

    monkeypatch.setattr(api, "chunk_gated_delta_rule", counted)
    _, step, checked, backward = {c[0]: c for c in bench.train_candidates()}[bench.API_ROW]
    assert checked
    x = _cpu_training_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time warning: the reference runs on the CPU
        want = step(x)
        assert len(forwards) == 1 and len(want) == 6 and all(d.shape == x[n].shape for d, n in zip(
            want, ("q", "k", "v", "g", "beta", "initial_state")))
        call = backward(x)
        assert len(forwards) == 2
        for _ in range(3):
            got = call()
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert len(forwards) == 2


def test_a_stage_rows_backward_is_its_run_alone(monkeypatch):
    """A gdn_bwd stage's row: the step runs the library's forward then the stage's ``run``; the
    backward runs ``run`` alone, on the backward's inputs, once a call."""
    from types import SimpleNamespace

    from flashqla import fwd

    calls = []
    module = SimpleNamespace(run=lambda **kw: calls.append(("run", sorted(kw))) or "grads")
    stage = SimpleNamespace(op="gdn_bwd", name="gdn_bwd/s99_fake", module=module, missing=lambda: None)
    monkeypatch.setattr(bench, "discover", lambda: [stage])
    monkeypatch.setattr(fwd, "forward", lambda *args: calls.append(("forward", len(args))))
    rows = {name: (step, backward) for name, step, _, backward in bench.train_candidates()}
    step, backward = rows["fwd + gdn_bwd/s99_fake"]
    x = _cpu_training_inputs()
    run = ("run", sorted(("q", "k", "v", "g", "beta", "do", "dht", "scale", "initial_state", "cu_seqlens")))
    assert step(x) == "grads" and calls == [("forward", 9), run]
    calls.clear()
    call = backward(x)
    assert calls == []
    assert call() == call() == "grads" and calls == [run, run]


@pytest.mark.parametrize("impl", [bench.API_ROW, bench.FLASHQLA_ROW])
def test_bwd_ms_is_the_same_timer_on_the_backward_alone(monkeypatch, impl):
    """``time_candidate``: the step, then the backward's calls (one per input set, the forward run
    before), with one timer (``time_peer_twice`` for a peer, ``time_row`` for ours) over the same
    sets; ``method`` names the backward's where it differs. A forward row has no ``bwd_ms``."""
    timed = []

    def timer(kind):
        def run(fn, sets, grad=False):
            timed.append((kind, [fn(x) for x in sets], grad))
            return (1.5, bench.GRAPH) if len(timed) == 1 else (0.5, "CUDA events, no graph (capture failed)")
        return run

    monkeypatch.setattr(bench, "time_row", timer("ours"))
    monkeypatch.setattr(bench, "time_peer_twice", timer("peer"))
    monkeypatch.setattr(bench, "eager_ms", lambda fn, sets, grad, ms: 2.0)
    monkeypatch.setattr(bench, "backward_calls", lambda backward, sets: [backward(x) for x in sets])
    sets = [dict(n=1), dict(n=2)]
    step = lambda x: ("step", x["n"])  # noqa: E731
    backward = lambda x: lambda: ("backward", x["n"])  # noqa: E731
    got = bench.time_candidate(impl, step, backward, sets, bench.TRAINING)
    kind = "peer" if impl == bench.FLASHQLA_ROW else "ours"
    assert timed == [(kind, [("step", 1), ("step", 2)], True), (kind, [("backward", 1), ("backward", 2)], True)]
    assert got == dict(ms=1.5, eager_ms=2.0, bwd_ms=0.5,
                       method=f"{bench.GRAPH}; bwd_ms: CUDA events, no graph (capture failed)")
    assert bench.row_methods(got) == (bench.GRAPH, "CUDA events, no graph (capture failed)")
    timed.clear()
    assert bench.time_candidate(impl, step, None, sets, bench.FORWARD) == dict(ms=1.5, eager_ms=2.0, method=bench.GRAPH)
    assert [t[2] for t in timed] == [False]


def test_bwd_ms_is_a_column_of_training_csvs_only(tmp_path):
    """``bwd_ms`` is one of COLUMNS: a training run's CSV has it (empty for rows timed before it
    existed), a forward run's does not; the Results page shows it where the CSV has it."""
    assert "bwd_ms" in bench.COLUMNS
    meta = dict(gpu="H100", commit="abc")
    old = dict(problem="(2, 8) 1x8192", impl="FLA", ms="0.9", method=bench.GRAPH, **meta)
    new = dict(problem="(2, 8) 1x8192", impl=bench.API_ROW, ms=0.6, method=bench.GRAPH, bwd_ms=0.4, **meta)
    bench.write_csv([old, new], tmp_path / "train.csv")
    read = bench.read_csv(tmp_path / "train.csv")
    assert [r["bwd_ms"] for r in read] == ["", "0.4"]
    bench.write_csv([{k: v for k, v in new.items() if k != "bwd_ms"}], tmp_path / "fwd.csv")
    assert "bwd_ms" not in bench.read_csv(tmp_path / "fwd.csv")[0]
    rows = [r for r in bench.read_csv(bench.RESULTS / "gdn_train.csv") if r["problem"] == "(2, 8) 1x8192"]
    page = bench.results_table(rows, bench.TRAINING)
    assert "backward ms" not in page
    for r, t in zip(rows, ("0.5", "0.2", "0.3")):
        r["bwd_ms"] = t
    rows[1]["method"] += "; bwd_ms: CUDA events, no graph (capture failed)"
    page = bench.results_table(rows, bench.TRAINING)
    assert "| backward ms: FLA, FlashQLA, API |" in page and "| 0.5 / 0.2 † / 0.3 |" in page
    assert f"| {rows[1]['ms']} |" in page  # the step's own time is a graph replay: unmarked
    assert "† CUDA events, no graph (capture failed)." in page
    assert all(len(line.split("|")) == len(page.splitlines()[0].split("|")) for line in page.splitlines()[:3])


@pytest.mark.gpu
def test_a_backward_whose_forward_ran_before_is_captured_in_a_graph():
    """On a GPU: an autograd row's backward alone (its forward run by ``backward_calls``, outside
    the capture) replays from a CUDA graph like its step: ``method`` names no fallback. Autograd
    runs a backward kernel on its forward's stream: with the forward on the default stream (not
    ``capture_stream()``), the backward's kernels would leave the capture and ``method`` would
    name the events fallback for bwd_ms."""
    def toy(q, k, v, g, beta, initial_state, **_):  # every input used; o and ht in the kernels' dtypes
        o = v.float() * ((q.float() * k.float()).sum(-1, keepdim=True) * (g * beta).unsqueeze(-1))
        return o.to(v.dtype), initial_state * beta.sum()

    _, step, _, backward = bench._autograd_row("toy", toy, False)
    p = Problem(1, 1, (300, 77))
    sets = bench.input_sets(p, 3 * bench.useful_bytes(p) // 2, training=True)
    assert len(sets) == 3
    times = bench.time_candidate("toy", step, backward, sets, bench.TRAINING)
    assert times["method"] == bench.GRAPH and times["bwd_ms"] > 0, times


def test_peers_warm_up_in_one_process_per_head_layout(monkeypatch, capsys):
    """start_peer_warmup: one child a head layout naming that layout's problems; its child calls
    each peer (never one of our rows) once on each named problem; a failed child is said, not fatal."""
    import subprocess

    started = []

    class Proc:
        def __init__(self, argv, **kw):
            started.append(argv)
            self.returncode = 1 if "(4, 16) 1x8192" in argv else 0

        def wait(self):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", Proc)
    problems = [p for p in bench.TRAINING.problems if (p.H, p.HV) in ((2, 8), (4, 16))]
    procs = bench.start_peer_warmup(bench.TRAINING, problems)
    assert sorted(procs) == [(2, 8), (4, 16)]
    for argv in started:
        H, HV = bench.heads_and_lengths(argv[4])[:2]
        assert argv[3] == "gdn_train"
        assert argv[4:] == [bench.short_label(p.label) for p in problems if (p.H, p.HV) == (H, HV)]
    bench.wait_peer_warmup(procs)
    assert "warming the peers on (4, 16) failed" in capsys.readouterr().out

    calls = []
    fake = [(name, lambda x, name=name: calls.append((name, x)), False, None)
            for name in (*bench.TRAINING.peers, bench.API_ROW)]
    monkeypatch.setattr(bench, "MODES", {"gdn_train": dataclasses.replace(
        bench.TRAINING, candidates=lambda: fake)})
    monkeypatch.setattr(bench, "problem_inputs", lambda p, seed, training: p.label)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    bench._run_peers_once("gdn_train", started[0][4:])
    want = [p.label for p in problems if bench.short_label(p.label) in started[0][4:]]
    assert calls == [(peer, label) for label in want for peer in bench.TRAINING.peers]


def _breakdown_lab():
    spec = importlib.util.spec_from_file_location("bwd_breakdown_lab", ROOT / "profiles" / "bwd_breakdown_lab.py")
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    return lab


def test_breakdown_lab_sums_each_kernel_per_step_and_names_unknown_rows():
    """profiles/bwd_breakdown_lab.py: CUDA events summed per kernel name over the profiled steps and
    divided by their count, largest first, CPU events left out (and the host's operations the same
    way, CUDA events left out); an unknown row is refused by name
    before anything touches a GPU."""
    lab = _breakdown_lab()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, us, dev=cuda: types.SimpleNamespace(name=name, device_time_total=us, device_type=dev)
    events = [ev("walk", 3000), ev("walk", 3400), ev("wy_bwd", 2000), ev("wy_bwd", 2200),
              ev("walk", 1e6, cpu), ev("finish", 300)]
    assert lab.per_kernel(events, 2) == [("walk", 3.2, 1), ("wy_bwd", 2.1, 1), ("finish", 0.15, 0)]
    host = [types.SimpleNamespace(name=n, self_cpu_time_total=us, device_type=cpu)
            for n, us in (("aten::empty", 40), ("launch", 900), ("aten::empty", 60))]
    assert lab.host_ops(host + [e for e in events if e.device_type == cuda], 2) == [("launch", 0.45), ("aten::empty", 0.05)]
    with pytest.raises(ValueError, match="not training rows"):
        lab.main(["--commit", "abc", "--rows", "fwd + gdn_bwd/s99_nothing"])
