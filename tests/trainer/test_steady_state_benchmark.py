"""``benchmarks/steady_state.py`` on CPU processes with gloo at a tiny model size: the plain
Megatron-Core loop and the real worker, alternated, each window training the steps asked for.

Scenarios: two plain ranks and two worker pods (DP=2) with the GPT configuration and the third arm
(``--decompose``: the worker's step function in the plain process); the worker is frozen between
its windows and thawed for the next, and every arm reports its measured steps and an overhead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--layers", "2", "--hidden", "64", "--heads", "8", "--seq", "32", "--vocab", "256"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_plain_loop_and_worker_alternate_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "steady_state.py"),
            *("--gpus", "2", "--configs", "gpt", "--decompose"),
            *("--rounds", "2", "--warmup", "2", "--steps", "3", "--out", str(out)),
            *TINY,
        ],
        cwd=REPO,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, f"steady_state.py failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    (config,) = json.loads(out.read_text())["configs"]
    assert config["config"] == "gpt" and config["gpus"] == 2
    windows = config["windows"]
    # Two rounds of three arms, alternating order; every window measured its three steps.
    assert [w["arm"] for w in windows] == ["plain", "worker", "worker-step", "worker-step", "worker", "plain"]
    for w in windows:
        assert len(w["step_s"]) == 3 and all(s > 0 for s in w["step_s"])
    for w in (w for w in windows if w["arm"] == "worker"):
        assert len(w["worker_reported_step_s"]) == 3
    assert config["plain"]["tokens_per_s"] > 0 and config["worker"]["tokens_per_s"] > 0
    assert "overhead_pct" in config and "worker_step_overhead_pct" in config
