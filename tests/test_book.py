"""The book builds offline with warnings as errors, executing every chapter, with math served locally."""

import subprocess
import sys
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"


@pytest.mark.slow
def test_book_builds(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                          str(BOOK), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    for page in ("index", "intro", "notation", "checking", *(f"notebooks/{p}" for p in (
            "01_recurrence", "02_chunked_form", "03_forward_kernels", "04_reformulation", "05_autocp",
            "06_backward"))):
        assert (tmp_path / f"{page}.html").exists(), page
    chapter = (tmp_path / "notebooks/02_chunked_form.html").read_text()
    assert "<img" in chapter                                   # executed: figures are in the page
    mathjax = [p for p in tmp_path.rglob("*.js") if "mathjax" in str(p).lower()]
    assert mathjax, "MathJax must be copied into the build (no CDN)"
    assert "cdn.jsdelivr" not in (tmp_path / "notation.html").read_text()
