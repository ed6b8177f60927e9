"""``benchmarks/step_replay.py`` on CPU processes with gloo at the tests' tiny size: a copy of each
rank's distributed-optimizer shard from an older step, brought forward by replaying the logged
updates (worker/step_log.py), is bitwise the shard training reached, whole and in two parts; one
update short is not (the benchmark on two GPUs: tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import run_benchmark

pytestmark = [pytest.mark.timeout(600)]


def test_replaying_the_logged_updates_brings_an_old_shard_copy_to_the_newest_step_bitwise(tmp_path: Path) -> None:
    args = ("--cpu", "--gpus", "2", "--global-batch", "4", "--warmup", "2", "--steps", "3")
    result = run_benchmark("step_replay.py", tmp_path / "replay.json", *args, cpu=True)
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for r in result["ranks"]:
        assert (r["from_step"], r["to_step"], r["updates_logged"]) == (2, 5, 3), r
        assert r["whole"]["bitwise"] and r["halves"]["bitwise"], r
        # The recipe's warm-up raised the learning rate every step, and the log has each step's.
        assert r["lr_logged"] == sorted(set(r["lr_logged"])) and len(r["lr_logged"]) == 3, r
        short = r["one_short"]
        assert not short["bitwise"] and not short["step_counts_equal"], short
        assert all(n > 0 for n in short["mismatching_elements"].values()), short
        # A step logs one fp32 gradient per shard element: a third of the shard's three columns
        # (less the shard's padding rows).
        assert 0.3 < r["log_bytes_per_step"] / r["shard_bytes"] <= 1 / 3, r
