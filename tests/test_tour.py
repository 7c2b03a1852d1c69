"""`python -m flashqla tour` runs the references and the API, the milestone stages this machine can
run (every stage with --all), lists once, by reason, those it cannot run, saves a plot and names
the next step; from an installed wheel (no kernels/) it says that stages need a checkout."""

import subprocess
import sys

import torch

from flashqla import tour
from flashqla.stages import MILESTONES, discover


def test_tour_runs(tmp_path):
    plot = tmp_path / "tour.png"
    out = subprocess.run([sys.executable, "-m", "flashqla", "tour", "--plot", str(plot)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference: naive recurrence, float64" in out.stdout
    assert "flashqla.chunk_gated_delta_rule" in out.stdout and "FAILED" not in out.stdout
    assert "chunk_kkt/s01_wgmma" not in out.stdout and "chunk_kkt" not in out.stdout  # milestones only
    if not torch.cuda.is_available():
        assert f"not run on this machine ({len(MILESTONES)} milestone stages):" in out.stdout
        assert "  no CUDA GPU on this machine: gdn_fwd s01 s02 s03 s04 s05 s06 s44; gdn_bwd s01 s02" in out.stdout
        assert "skipped" not in out.stdout and len(out.stdout.splitlines()) < 20
    assert out.stdout.splitlines()[-1] == tour.NEXT_STEP
    assert plot.stat().st_size > 1000


def test_milestones_by_default_every_stage_with_all():
    stages = discover()
    assert [s.id for s in tour.select(stages, all_stages=False)] == list(MILESTONES)
    assert tour.select(stages, all_stages=True) == stages


def test_stages_not_run_are_one_line_a_reason():
    stages = discover()
    not_run = [(s, "no CUDA GPU on this machine") for s in stages if s.op != "gdn_fwd"]
    not_run += [(s, "needs the `fla` package") for s in stages if s.id == "gdn_fwd.s00"]
    lines = tour.not_run_lines(not_run, milestones_only=False)
    assert lines[0] == f"not run on this machine ({len(not_run)} stages):"
    assert lines[-1] == "  needs the `fla` package: gdn_fwd s00"
    assert "chunk_kkt s01 s02;" in " ".join(lines[1:-1])
    assert all(len(line) <= 100 for line in lines)
    assert tour.not_run_lines([], milestones_only=True) == []


def test_installed_wheel_says_stages_need_a_checkout(tmp_path, monkeypatch, capsys):
    """Without kernels/ next to the package, no stage is found, and the tour says why and where
    to get them (the references and the API still run; stubbed here)."""
    missing = tmp_path / "site-packages" / "kernels"
    assert tour.select(discover(missing), all_stages=False) == []
    monkeypatch.setattr(tour, "run_tour", lambda stages: (tour.CPU_PROBLEM, [tour.Row("stub", "cpu", ms=1.0)], []))
    monkeypatch.setattr(tour, "plot", lambda *args: None)
    assert tour.main(tmp_path / "tour.png", kernels_dir=missing) == 0
    out = capsys.readouterr().out
    assert tour.NO_CHECKOUT in out and "--all" not in out
    assert out.splitlines()[-1] == tour.NEXT_STEP_NO_CHECKOUT
