"""The book builds offline with warnings as errors, from the chapters as this session executed them
(each chapter runs once: ``execute_chapter``), with math served locally and the generated pages."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHAPTERS

BOOK = Path(__file__).resolve().parent.parent / "book"


@pytest.mark.slow
def test_book_builds(tmp_path, execute_chapter):
    src, out = tmp_path / "src", tmp_path / "html"
    shutil.copytree(BOOK, src, symlinks=True, ignore=shutil.ignore_patterns("_build", "notebooks"))
    (src / "notebooks").mkdir()
    for path in CHAPTERS:
        shutil.copy(execute_chapter(path).ipynb, src / "notebooks")
    built = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                            "-D", "nb_execution_mode=off", str(src), str(out)],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout[-5000:] + built.stderr[-5000:]
    for page in ("index", "intro", "notation", "checking", "results", "nsight_labs", "lab_log", "cp",
                 *(f"notebooks/{p.stem}" for p in CHAPTERS)):
        assert (out / f"{page}.html").exists(), page
    chapter = (out / "notebooks/02_chunked_form.html").read_text()
    assert "<img" in chapter                                   # executed: figures are in the page
    mathjax = [p for p in out.rglob("*.js") if "mathjax" in str(p).lower()]
    assert mathjax, "MathJax must be copied into the build (no CDN)"
    assert "cdn.jsdelivr" not in (out / "notation.html").read_text()
