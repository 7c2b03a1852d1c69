"""Markers and the rule that a run in which nothing passed fails.

`gpu` tests skip without a CUDA GPU and `hopper` tests without an SM90 GPU, each with its reason.
A session whose selected tests were all skipped (say `pytest -m gpu` on a CPU machine) exits with
status 1 instead of passing silently.
"""

import pytest
import torch

from flashqla.hopper import hopper_gpu_missing


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(
                reason="needs a CUDA GPU: run `python3 -m pytest -m gpu` on the GPU machine"))
        elif "hopper" in item.keywords and hopper_gpu_missing():
            item.add_marker(pytest.mark.skip(reason=hopper_gpu_missing()))


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter else 0
    if exitstatus == 0 and session.testscollected and passed == 0:
        if reporter:
            reporter.ensure_newline()
            reporter.write_line("flashqla: every selected test was skipped; failing the run", red=True)
        session.exitstatus = 1
