"""The session-end check of ``leftover_processes`` fails a session that leaves a process running.

Scenarios, each a nested pytest session in a subprocess with the plugin loaded:

- a test starts a process that outlives it, reparented to init (not a descendant of pytest any
  more): the session fails naming the process, and the check kills it;
- a test that waits for the process it started: the session passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from leftover_processes import ENV_GRACE
from localcluster.waiting import wait_for

TESTS = Path(__file__).resolve().parent

LEAKING = """
import subprocess
from pathlib import Path

def test_leaves_a_process_behind(tmp_path):
    # The shell exits at once; its background sleep is reparented to init.
    subprocess.run(["sh", "-c", "sleep 300 & echo $! > {pidfile}"], check=True)
"""

CLEAN = """
import subprocess

def test_waits_for_its_process():
    subprocess.run(["sleep", "0.1"], check=True)
"""


def run_session(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env[ENV_GRACE] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "leftover_processes", "-p", "no:cacheprovider", "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "sleeper.pid"
    result = run_session(tmp_path, LEAKING.format(pidfile=pidfile))
    pid = int(pidfile.read_text())
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        assert "still running" in result.stdout and f"pid {pid}: sleep 300" in result.stdout
        wait_for(lambda: not alive(pid), 10, f"the check to kill the leftover sleep {pid}")
    finally:
        if alive(pid):
            os.kill(pid, 9)


def test_a_session_that_cleans_up_passes(tmp_path: Path) -> None:
    result = run_session(tmp_path, CLEAN)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "still running" not in result.stdout
