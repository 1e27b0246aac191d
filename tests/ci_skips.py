"""Under CI (``DDTREE_CI=1``, set by ``.ci/run``) a skipped test fails the run, except for the skips
CI's machine is known to need: it has no GPU and no docker, and may run outside a git checkout. A
kernel test skipped because Triton did not import, say, would otherwise let CI pass with the kernel
untested.

``tests/conftest.py`` takes these hooks; ``pytest -p ci_skips`` loads them alone.
"""

from __future__ import annotations

import os

import pytest

# A CPU machine, no docker, maybe no .git; "needs 2 GPUs" also skips on a one-GPU machine.
CI_SKIPS = ("needs CUDA", "needs 2 GPUs", "docker compose not installed", "no git checkout")
_unexpected: list[str] = []


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("DDTREE_CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = _reason(report)
        if reason not in CI_SKIPS:
            _unexpected.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter) -> None:
    if _unexpected:
        terminalreporter.section("skips CI does not allow", sep="=", red=True, bold=True)
        for line in _unexpected:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
