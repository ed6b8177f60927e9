"""The recovery benchmarks' two-GPU modes on CPU processes with gloo at a tiny model size: with no
room for a spare, a fault is a shrink (the survivor trains alone, from its own memory) and a grow (a
new pod joins, its state from the survivor). ``trainer_recovery.py`` records every figure and phase
of each; ``trainer_loss_parity.py`` compares the losses with a failure-free run; ``agent_recovery.py``
does it through the real pod agents."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import run_benchmark

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_two_gpus_measure_shrink_then_grow_for_every_fault(tmp_path: Path) -> None:
    result = run_benchmark(
        "trainer_recovery.py", tmp_path / "recovery.json", "--gpus", "2", "--faults", "2", *TINY, cpu=True
    )
    rows = result["faults"]
    assert [(r["fault"], r["kind"]) for r in rows] == [(0, "shrink"), (0, "grow"), (1, "shrink"), (1, "grow")]
    for shrink in rows[::2]:
        assert shrink["fault_to_next_step_s"] > 0 and shrink["rebuild"] > 0 and shrink["first_step"] > 0
    for grow in rows[1::2]:
        assert grow["boundary_to_next_step_s"] > 0 and grow["restore"] > 0  # the newcomer's state from the peer
    assert result["summary"]["shrink"]["n"] == result["summary"]["grow"]["n"] == 2


def test_two_gpus_loss_parity_through_a_shrink_and_a_grow(tmp_path: Path) -> None:
    """``trainer_loss_parity.py --gpus 2``: the run that shrinks to DP 1 and grows back matches the
    failure-free run bit for bit on CPU (gloo sums a step's gradients in the same order either way)."""
    args = ("--gpus", "2", "--steps", "16", "--fault-step", "5", *TINY)
    result = run_benchmark("trainer_loss_parity.py", tmp_path / "parity.json", *args, cpu=True)
    faulty = result["summary"]["faulty"]
    assert faulty["steps"] == 16 and faulty["steps_after_fault"] == 11
    assert faulty["bitwise_equal_steps"] == 16, faulty


def test_recovery_through_the_real_agents_reports_each_share(tmp_path: Path) -> None:
    """``agent_recovery.py --gpus 2``: real agent processes supervise the workers; a killed worker's
    agent reports to the recording operator, and the plan pushed to the control
    port brings the job back (a shrink, then a new pod grows it for the next fault)."""
    result = run_benchmark(
        "agent_recovery.py", tmp_path / "agent.json", "--gpus", "2", "--faults", "2", *TINY, cpu=True
    )
    rows = result["faults"]
    assert [(r["fault"], r["plan"], r["epoch"]) for r in rows] == [(0, "shrink", 2), (1, "shrink", 4)]
    for r in rows:
        assert 0 < r["b_report_s"] < r["first_step_s"]
        assert r["a_report_s"] is None or 0 < r["a_report_s"] < r["first_step_s"]
        assert r["push_s"] > 0 and r["phases"]["rebuild"] > 0 and r["phases"]["first_step"] > 0
