"""`python -m flashqla tour` prints its table, names what it skipped and why, and saves a plot."""

import subprocess
import sys

import torch


def test_tour_runs(tmp_path):
    plot = tmp_path / "tour.png"
    out = subprocess.run([sys.executable, "-m", "flashqla", "tour", "--plot", str(plot)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference: naive recurrence, float64" in out.stdout
    assert "flashqla.chunk_gated_delta_rule" in out.stdout and "FAILED" not in out.stdout
    if not torch.cuda.is_available():
        assert "chunk_kkt/s01_wgmma" in out.stdout and "skipped: no CUDA GPU" in out.stdout
    assert plot.stat().st_size > 1000
