"""``benchmarks/distributed_optimizer.py`` on CPU processes with gloo at a tiny model size: the
steady arms (no copies, copies every 1 and every 3 steps, copies within a 50 % cost budget, two
rounds, each compared with its round's no-copies epoch), the shrink that takes the lost shard from
the survivor's buddy copy (with the budget too, so after an agreed interval), the growth that
reshards it, the same shrink from the newest checkpoint, and every step's samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import REPO, run_benchmark

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_two_processes_measure_the_copies_then_recover_from_them_and_from_the_checkpoint(tmp_path: Path) -> None:
    args = ("--gpus", "2", "--global-batch", "4", "--steps", "2", "--rounds", "2", "--steady-intervals", "1,3")
    args += ("--steady-budgets", "50", "--replica-cost-percent", "50")
    result = run_benchmark(
        "distributed_optimizer.py", tmp_path / "distopt.json", *args, "--checkpoint-interval", "6", *TINY, cpu=True
    )
    steady = result["steady"]
    arms = ["copies every 1", "copies every 3", "copies within 50 %"]
    assert all(len(steady["epoch_wall_s_per_step"][k]) == 2 for k in ["none", *arms])
    for kind in arms:
        walls, without = steady["epoch_wall_s_per_step"][kind], steady["epoch_wall_s_per_step"]["none"]
        want = [round(100 * (a / n - 1), 2) for a, n in zip(walls, without, strict=True)]
        assert steady["overhead_percent_by_round"][kind] == want
        assert len(steady["median_step_overhead_percent_by_round"][kind]) == 2
    assert steady["no_copies_spread_percent"] >= 0
    # The budget's epochs calibrated, then agreed on an interval they were timed at.
    calibrated = steady["calibrated"]["copies within 50 %"]
    assert len(calibrated) == 2 and all(c["interval"] >= c["proposed_by_a"] >= 1 for c in calibrated), calibrated
    # The rare refreshes' epochs also compare the steps beside a refresh with the others.
    budget_rare = any(c["interval"] >= 3 for c in calibrated)
    assert set(steady["paired_refresh_cost"]) == {"copies every 3", *(["copies within 50 %"] if budget_rare else [])}
    for row in steady["paired_refresh_cost"]["copies every 3"]:
        assert row["steps_beside"] >= 1 and row["steps_clear"] >= 1, row
        assert row["cost_s"] == pytest.approx(row["beside_s"] - row["clear_s"], abs=2e-4)
    # The second round runs its arms in reverse: a drifting host favours no arm.
    assert steady["arms_in_order"] == ["none", *arms, *arms[::-1], "none"]
    # Every epoch with copies logged its refreshes, each moving both shards into host memory.
    assert len(steady["refresh_times"]) == 6
    for pods in steady["refresh_times"].values():
        assert all(pods[p]["first"]["bytes_to_host"] > 0 for p in ("a", "b"))

    shrink = result["shrink_in_memory"]
    assert shrink["source"] == "reshard"
    copies = {c["previous_rank"]: (c["holder_pod"], c["buddy"]) for c in shrink["copies"]}
    assert copies[1] == ("a", True), copies  # b's shard from the copy a kept of it
    # a's own from its GPU, or from its own snapshot when the copies' step is older than a's.
    assert copies.get(0, ("a", False)) == ("a", False) and set(copies) <= {0, 1}, copies
    assert 0 <= shrink["steps_redone"] <= shrink["steps_redone_planned"] and shrink["kill_to_first_step_s"] > 0
    # Copies every N agreed steps: the newest complete one at most two intervals old.
    assert shrink["steps_redone"] <= 2 * result["failure_interval"]["interval"], (shrink, result["failure_interval"])
    grow = result["grow_in_memory"]
    assert grow["steps_redone"] == 0 and grow["restored_step"] == grow["boundary"]
    assert grow["phases_by_pod"]["c"]["restore"] > 0  # the newcomer's shard resharded from a's
    from_checkpoint = result["shrink_from_checkpoint"]
    assert from_checkpoint["checkpoint_step"] > 0 and from_checkpoint["steps_redone"] >= 0
    assert result["samples"]["steps_checked"] > grow["boundary"]
    assert result["shrink_ratio_in_memory_to_checkpoint"] > 0


def test_a_refresh_is_charged_to_the_step_beside_it_against_the_steps_two_or_more_after_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from distributed_optimizer import refresh_cost

    # Copies every 4 steps: a refresh starts at step counts 8, 12, 16 and runs beside the step that
    # completes 9, 13, 17; the step after it (10, 14) may carry what it outlasted, and is left out.
    times = {9: 0.5, 10: 0.45, 11: 0.4, 12: 0.42, 13: 0.52, 14: 0.41, 15: 0.4, 16: 0.4, 17: 0.54}
    got = refresh_cost(times, 4)
    assert (got["steps_beside"], got["steps_clear"]) == (3, 4)
    assert got["beside_s"] == 0.52 and got["clear_s"] == 0.4
    assert got["cost_s"] == 0.12 and got["percent"] == 30.0
    with pytest.raises(ValueError, match="no steps to compare"):
        refresh_cost({9: 0.5, 10: 0.4}, 4)
