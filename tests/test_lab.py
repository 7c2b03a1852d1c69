"""`python -m flashqla lab`: JupyterLab over the chapters with "Jupytext Notebook" as the default
viewer of .py files, checked without starting a server."""

import json
import os
import sys

from flashqla import __main__ as cli

DOCMANAGER = "@jupyterlab/docmanager-extension:plugin"


def test_lab_settings_open_python_files_as_jupytext_notebooks():
    """JupyterLab reads ``labconfig/default_setting_overrides.json`` from every directory on
    JUPYTER_CONFIG_PATH; ours sets the default viewer of the "python" file type (.py) and nothing else."""
    settings = json.loads((cli.LAB_CONFIG / "labconfig" / "default_setting_overrides.json").read_text())
    assert settings == {DOCMANAGER: {"defaultViewers": {"python": "Jupytext Notebook"}}}


def test_lab_command_runs_jupyter_lab_in_the_notebooks_with_our_settings_first(monkeypatch):
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", "/somewhere/else")
    argv, env, cwd = cli.lab_command(["--port", "8899"])
    assert argv == [sys.executable, "-m", "jupyterlab", "--port", "8899"]
    assert cwd == cli.CHECKOUT / "notebooks" and sorted(cwd.glob("01_*.py"))
    # the first entry has the highest priority; the user's own entries are kept after it
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(cli.LAB_CONFIG), "/somewhere/else"]
    monkeypatch.delenv("JUPYTER_CONFIG_PATH")
    assert cli.lab_command()[1]["JUPYTER_CONFIG_PATH"] == str(cli.LAB_CONFIG)


def test_lab_without_the_lab_extra_says_what_to_install(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: started.append(a))
    assert cli.main(["lab"]) == 1 and not started
    assert 'pip install -e ".[lab]"' in capsys.readouterr().err


def test_lab_from_an_installed_wheel_says_it_needs_a_checkout(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)  # site-packages: no notebooks/ beside the package
    assert cli.main(["lab"]) == 2
    assert "needs a checkout of the repository" in capsys.readouterr().err


def test_other_commands_reject_unknown_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit):
        cli.main(["bench", "--report", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
