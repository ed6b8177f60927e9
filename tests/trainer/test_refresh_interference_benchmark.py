"""The paired cost of ``benchmarks/refresh_interference.py``: which steps it charges a refresh to,
and which it compares them with (the benchmark itself needs two GPUs: tests/gpu)."""

from __future__ import annotations

import pytest

from benchmark_runs import REPO


def test_a_refresh_is_charged_to_the_step_beside_it_against_the_step_that_starts_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from refresh_interference import INTERVAL, WARM_STEPS, paired_cost

    assert (INTERVAL, WARM_STEPS) == (3, 4)
    # Refreshes start after steps 0, 3, 6, 9 and run beside steps 1, 4, 7, 10; steps 5 and 8 may
    # carry what one outlasted and are left out; steps 6 and 9 start the next refresh clear of one.
    times = [9.0, 9.0, 9.0, 9.0, 0.50, 0.70, 0.40, 0.52, 0.60, 0.42, 0.54]
    got = paired_cost(times)
    assert got["beside_s"] == 0.52 and got["clear_s"] == pytest.approx(0.41)
    assert got["cost_ms"] == pytest.approx(110.0) and got["cost_percent"] == pytest.approx(100 * (0.52 / 0.41 - 1))
    assert got["pairs"] == 2 and got["median_step_s"] == 0.52
    with pytest.raises(ValueError, match="no step beside a refresh"):
        paired_cost(times[:6])


def test_an_arm_named_twice_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from refresh_interference import main

    monkeypatch.setattr("sys.argv", ["refresh_interference.py", "--arms", "none,full,none"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "names an arm twice" in capsys.readouterr().err
