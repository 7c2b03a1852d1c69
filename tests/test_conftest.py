"""The suite's own rule: a run in which every selected test was skipped exits non-zero."""

import shutil
import subprocess
import sys
from pathlib import Path


def _run(tmp_path, body):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_one.py").write_text("import pytest\n\n\ndef test_one():\n" + body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)


def test_all_skipped_fails(tmp_path):
    out = _run(tmp_path, "    pytest.skip('no GPU here')\n")
    assert out.returncode == 1, out.stdout
    assert "every selected test was skipped" in out.stdout


def test_a_pass_passes(tmp_path):
    assert _run(tmp_path, "    assert 1 + 1 == 2\n").returncode == 0
