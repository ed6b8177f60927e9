"""``benchmarks/restart_vs_in_place.py`` on CPU processes with gloo at a tiny model size: the three
arms run on one job (a peer-restored shrink, warm spares restoring the checkpoint, a cold restart
restoring it) and their accounting holds: no step redone from a peer, the steps since the
checkpoint redone by the other two, and the ratios taken against the cold restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import run_benchmark

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_in_place_and_cold_restart_arms_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    result = run_benchmark(
        "restart_vs_in_place.py", out, *("--gpus", "2", "--interval", "6", "--steps-after", "3"), *TINY, cpu=True
    )
    peer, warm, cold = result["arms"]
    assert peer["arm"].startswith("in place, from a DP peer") and peer["steps_redone"] == 0
    for arm in (warm, cold):
        # Killed inside the step after --steps-after more steps: those, and the one in flight, are redone
        # from the checkpoint (a multiple of the interval).
        assert arm["resumed_after_step"] % 6 == 0
        assert arm["steps_redone"] == arm["step_reached_at_kill"] - arm["resumed_after_step"] >= 3
        assert arm["kill_to_caught_up_s"] >= arm["kill_to_first_step_s"] > 0
    assert cold["first_step_vs_cold"] == 1.0
    assert warm["first_step_vs_cold"] == warm["kill_to_first_step_s"] / cold["kill_to_first_step_s"]
