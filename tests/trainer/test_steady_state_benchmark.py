"""``benchmarks/steady_state.py`` on CPU processes with gloo at a tiny model size: the plain
Megatron-Core loop and the real worker, alternated, each window training the steps asked for.

Scenarios: two plain ranks and two worker pods (DP=2) with the GPT configuration and the third arm
(``--decompose``: the worker's step function in the plain process); the worker is frozen between
its windows and thawed for the next, and every arm reports its measured steps and an overhead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import run_benchmark

TINY = ["--layers", "2", "--hidden", "64", "--heads", "8", "--seq", "32", "--vocab", "256"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_plain_loop_and_worker_alternate_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    result = run_benchmark(
        "steady_state.py",
        out,
        *("--gpus", "2", "--configs", "gpt", "--decompose"),
        *("--rounds", "2", "--warmup", "2", "--steps", "3"),
        *TINY,
        cpu=True,
    )
    (config,) = result["configs"]
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
