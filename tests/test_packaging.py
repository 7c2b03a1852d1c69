"""The wheel and the sdist carry the LICENSE and py.typed (built from a copy of the package)."""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_and_sdist_carry_license_and_py_typed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "flashqla", src / "flashqla", ignore=shutil.ignore_patterns("__pycache__"))
    dist = str(tmp_path / "dist")  # a literal: build_meta rewrites sys.argv
    build = f"from setuptools import build_meta as b; b.build_wheel({dist!r}); b.build_sdist({dist!r})"
    subprocess.run([sys.executable, "-c", build], cwd=src, check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    in_wheel = zipfile.ZipFile(wheel).namelist()
    in_sdist = [Path(n).relative_to(Path(n).parts[0]).as_posix() for n in tarfile.open(sdist).getnames()[1:]]
    assert "flashqla/py.typed" in in_wheel and "flashqla/py.typed" in in_sdist
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in in_wheel) and "LICENSE" in in_sdist
    assert "flashqla/integrations/fla.py" in in_wheel
