"""worker/writer_processes.py: the checkpoint writers' results manager leaves nothing in the
temporary directory, even when it is killed with its worker (the writers themselves: the worker
checkpoint tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_trainer.agent.supervisor import signal_group

_WORKER = """
from megatron_trainer.worker.writer_processes import results_queue
queue = results_queue()
queue.put({"ok": 1})
assert queue.get() == {"ok": 1}
print("ready", flush=True)
import time
time.sleep(120)
"""


def test_the_results_manager_killed_with_its_worker_leaves_no_file_behind(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE, text=True, process_group=0
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        assert list(tmp.iterdir()) == []  # the manager runs and answers, from an abstract socket
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        assert list(tmp.iterdir()) == []
    finally:
        signal_group(worker.pid, signal.SIGKILL)  # the manager too, if the kernel has not yet
        worker.wait()
