"""A pytest plugin: the session fails if a process it started is still running when it ends.

Every process the suite starts inherits ``MEGATRON_TEST_SESSION`` (set here, at import, to the
pytest process's id), children of children and processes reparented to init included. At session
finish, after every fixture (the local control plane too) has been torn down, the plugin looks for
live processes whose initial environment carries this session's mark, gives processes that are
just exiting a few seconds, then reports what is left, kills it, and fails the session.
Loaded by ``tests/conftest.py``; its own test runs it in a nested session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

ENV_SESSION = "MEGATRON_TEST_SESSION"
ENV_GRACE = "MEGATRON_TEST_EXIT_GRACE_SECONDS"  # the plugin's own test shortens it
EXIT_GRACE_SECONDS = 10.0

os.environ[ENV_SESSION] = str(os.getpid())


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]  # the command may contain spaces and parentheses


def _environment_marks(pid: int, mark: bytes) -> bool:
    return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def marked_processes(session: str) -> dict[int, str]:
    """Live processes (zombies excluded) started with ``MEGATRON_TEST_SESSION=session``, by pid,
    with their command lines; this process excluded."""
    mark = f"{ENV_SESSION}={session}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            if _state(pid) in "ZX" or not _environment_marks(pid, mark):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        found[pid] = cmdline
    return found


def leftovers(session: str, grace: float = EXIT_GRACE_SECONDS) -> dict[int, str]:
    """Marked processes still alive after ``grace`` seconds (processes being killed need a moment)."""
    deadline = time.monotonic() + grace
    while True:
        found = marked_processes(session)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if processes it started outlived it; kill them so they do not linger."""
    found = leftovers(os.environ[ENV_SESSION], float(os.environ.get(ENV_GRACE, EXIT_GRACE_SECONDS)))
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(found)} process(es) started by the test session are still running:"]
    lines += [f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(found.items())]
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    text = "\n".join(lines)
    if reporter is not None:
        reporter.write_sep("=", "leftover processes", red=True)
        reporter.write_line(text)
    else:
        print(text)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
