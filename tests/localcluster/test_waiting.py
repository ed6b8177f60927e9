"""``wait_for``: returns the first truthy value, fails with the caller's error type and details after
the deadline, counts only the listed exceptions as "not yet", and lets any other one through."""

from __future__ import annotations

import itertools
import time

import pytest

from localcluster.waiting import wait_for


class CustomError(Exception):
    pass


def test_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, "", {"step": 3}, {"step": 4}])
    assert wait_for(lambda: next(values), 5, "a status", interval=0) == {"step": 3}


def test_times_out_with_the_callers_error_and_details() -> None:
    calls = itertools.count()
    started = time.monotonic()
    with pytest.raises(CustomError) as caught:
        wait_for(lambda: next(calls) < 0, 0.2, "the job", interval=0.01, error=CustomError, details=lambda: "log tail")
    assert time.monotonic() - started >= 0.2
    assert str(caught.value) == "timed out after 0.2 s waiting for the job\nlog tail"
    assert next(calls) > 2, "polled more than once"


def test_default_error_is_timeout_error_and_the_condition_runs_at_least_once() -> None:
    calls = itertools.count()
    with pytest.raises(TimeoutError, match=r"waiting for nothing$"):
        wait_for(lambda: next(calls) < 0, 0, "nothing")
    assert next(calls) == 1


def test_listed_exceptions_mean_not_yet_and_the_last_is_named() -> None:
    attempts = iter([ConnectionRefusedError("refused"), KeyError("state"), "up"])

    def probe() -> str:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert wait_for(probe, 5, "the agent", interval=0, retry_on=(OSError, KeyError)) == "up"

    def refused() -> bool:
        raise ConnectionRefusedError("refused")

    with pytest.raises(TimeoutError, match=r"\(last error: ConnectionRefusedError\('refused'\)\)$"):
        wait_for(refused, 0.05, "the agent", retry_on=(OSError,))


def test_other_exceptions_end_the_wait_at_once() -> None:
    def broken() -> bool:
        raise ValueError("bad answer")

    started = time.monotonic()
    with pytest.raises(ValueError, match="bad answer"):
        wait_for(broken, 30, "anything", retry_on=(OSError,))
    assert time.monotonic() - started < 5
