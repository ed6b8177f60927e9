"""Waiting for a condition with a deadline: the one polling loop of the local cluster, the chaos run,
the demo, the tests and the benchmarks. Each caller names what it waits for and how a timeout
fails (its own error type, details such as a log tail) rather than writing the loop again."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for[T](
    condition: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    error: Callable[[str], Exception] = TimeoutError,
    details: Callable[[], str] | None = None,
    retry_on: tuple[type[Exception], ...] = (),
) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Args:
        condition: called at least once; an exception it raises ends the wait, unless listed in
            ``retry_on`` (then it counts as "not yet", and the last one is named on timeout).
        timeout: seconds from now.
        what: what is awaited, for the message ("timed out after 30 s waiting for <what>").
        interval: seconds between two calls.
        error: builds the exception raised on timeout from the message.
        details: called on timeout only; its text follows the message on a line of its own
            (a log tail, a dump of the cluster).

    Raises:
        what ``error`` builds, after ``timeout`` seconds without a truthy value.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = condition()
        except retry_on as err:
            last_error = err
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout:g} s waiting for {what}"
            if last_error is not None:
                message += f" (last error: {last_error!r})"
            if details is not None:
                message += f"\n{details()}"
            raise error(message)
        time.sleep(interval)
