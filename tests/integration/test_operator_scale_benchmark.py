"""``benchmarks/operator_recovery.py`` at a tiny size on the local control plane: the operator as a
real process pushing every plan from two push processes, the recording agents split over two
processes by pod address.

Scenario: 8 worker pods and 2 spares, 3 failures; every failure is a replacement measured at every
member (so the members of each plan were served by both agents' processes, and pushed by both push
processes, or by the operator's own while they started), and the operator's CPU and peak memory,
and its push processes', are read; each failure is split into its parts from the operator's log.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_runs import run_benchmark

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


def test_replacements_are_measured_with_the_agents_in_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    result = run_benchmark(
        "operator_recovery.py",
        out,
        *("--workers", "8", "--spares", "2", "--failures", "3", "--steady-seconds", "2"),
        *("--agent-processes", "2", "--push-processes", "2", "--push-process-min-members", "2"),
    )
    (size,) = result["sizes"]
    assert size["workers"] == 8 and size["agent_processes"] == 2 and size["push_processes"] == 2
    assert len(size["push_processes_peak_rss_mib"]) == 2 and min(size["push_processes_peak_rss_mib"]) > 0
    log = Path(size["operator_log"]).read_text()
    # Every failure's plan went out from the push processes (they start with the job; the first plan
    # may still come before they are ready).
    assert log.count("members in") >= 4 and log.count("from 2 push processes") >= 3, log[-3000:]
    assert "push process" not in log.replace("from 2 push processes", ""), log[-3000:]
    assert size["measured"] == 3 and size["excluded"] == []
    stored, pushed = size["stored_s"], size["pushed_s"]
    assert 0 < stored["min"] <= stored["max"] and 0 < pushed["min"] <= pushed["max"]
    assert size["operator_cpu_s"]["failures"] > 0 and size["operator_peak_rss_mib"] > 0
    peaks = size["operator_peak_rss_mib_by_phase"]
    phases = ["every pod created", "every pod running", "first step", "training", "first failure", "failures"]
    assert list(peaks) == phases
    assert list(peaks.values()) == sorted(peaks.values()) and peaks["failures"] == size["operator_peak_rss_mib"]
    series = size["operator_rss_mib_series"]
    assert len(series) >= 10 and all(0 < mib <= peaks["failures"] + 1 for _, mib in series)
    memory = size["operator_memory_at_end"]
    assert set(memory) == {"anon_mib", "file_mib", "shmem_mib", "threads"} and memory["threads"] >= 2
    assert 0 < memory["anon_mib"] + memory["file_mib"] <= peaks["failures"] + 1
    # Each failure split from the operator's log (failure_split.py): its plan's line and its push's
    # line found, on one clock: the pass woken after the delete (log stamps are whole ms: 2 ms of
    # slack). The watch may see the status before the operator, answered, logs its line: the
    # remainder can be a little below zero, never by a whole pass.
    split = size["failure_split"]
    assert [r["epoch"] for r in split] == [t["epoch"] for t in size["timeline"]], (split, log[-3000:])
    for r in split:
        assert r["wake_lag_ms"] > -2 and min(r["read_ms"], r["assess_ms"], r["write_ms"]) >= 0, r
        assert r["watch_lag_ms"] > -r["write_ms"] - 2 and r["push_ms"] > 0, r
