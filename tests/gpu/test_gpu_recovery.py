"""The trainer's recovery scenarios on GPUs with NCCL, through the benchmark scripts at a small
model size: SIGKILL of a training worker mid-step, the warm spare promoted with state broadcast
from a DP peer (``trainer_recovery.py``), the loss after that recovery against a failure-free run
(``trainer_loss_parity.py``), and a hung worker, a shrink and a growth on one job with exact sample
accounting (``trainer_scenarios.py``, 4 devices); on two devices, the shrink and grow of
``trainer_recovery.py``, ``trainer_loss_parity.py`` and ``agent_recovery.py`` (through the real pod
agents). Skipped where too few CUDA devices exist (CI has none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmark_runs import run_benchmark

GPUS = torch.cuda.device_count()
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab", "1024"]

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
three_gpus = pytest.mark.skipif(
    GPUS < 3, reason=f"needs 3 CUDA devices (2 DP replicas and a spare); this machine has {GPUS}"
)
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices (2 DP replicas); this machine has {GPUS}")


def run_script(name: str, out: Path, *args: str, gpus: int = min(GPUS, 4)) -> Any:
    return run_benchmark(name, out, "--gpus", str(gpus), *SMALL, *args)


@three_gpus
def test_a_killed_gpu_worker_is_replaced_in_place(tmp_path: Path) -> None:
    result = run_script("trainer_recovery.py", tmp_path / "recovery.json", "--faults", "2")
    assert result["summary"]["n"] == 2
    for fault in result["faults"]:
        assert fault["resume_step"] > 0
        for phases in fault["phases_by_pod"].values():
            assert {"rendezvous", "rebuild", "restore", "verify", "first_step"} <= phases.keys()


@three_gpus
def test_loss_after_a_gpu_recovery_stays_with_the_failure_free_run(tmp_path: Path) -> None:
    result = run_script("trainer_loss_parity.py", tmp_path / "parity.json", "--steps", "16", "--fault-step", "6")
    faulty = result["summary"]["faulty"]
    assert faulty["steps"] == 16
    # GPU kernels are not bitwise reproducible run to run (benchmarks/results: two failure-free
    # runs differ from step 1), so this bounds the drift: a spare that resumed from wrong or
    # uninitialized state would be off by far more than a few percent.
    assert faulty["max_rel_diff_after_fault"] < 0.05, faulty


@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 CUDA devices (3 trainers and a spare); this machine has {GPUS}")
def test_a_hung_worker_then_shrink_then_growth_on_gpus(tmp_path: Path) -> None:
    result = run_script("trainer_scenarios.py", tmp_path / "scenarios.json")
    assert [s["scenario"].split(":")[0] for s in result["scenarios"]] == [
        "hang (SIGSTOP) replaced by the spare",
        "kill without a spare",
        "grow",
    ]
    assert result["checked_steps"] > 12  # every step's samples, exactly once (checked by the script)


@two_gpus
def test_two_gpus_shrink_and_grow_in_place(tmp_path: Path) -> None:
    result = run_script("trainer_recovery.py", tmp_path / "recovery.json", "--faults", "2", gpus=2)
    assert [r["kind"] for r in result["faults"]] == ["shrink", "grow"] * 2
    parity = run_script(
        "trainer_loss_parity.py", tmp_path / "parity.json", "--steps", "16", "--fault-step", "6", gpus=2
    )
    assert parity["summary"]["faulty"]["max_rel_diff_after_fault"] < 0.05, parity["summary"]


@two_gpus
def test_two_gpus_recovery_through_the_real_agents(tmp_path: Path) -> None:
    result = run_script("agent_recovery.py", tmp_path / "agent.json", "--faults", "2", gpus=2)
    assert [r["plan"] for r in result["faults"]] == ["shrink", "shrink"]
    assert all(0 < r["b_report_s"] < r["first_step_s"] for r in result["faults"])
