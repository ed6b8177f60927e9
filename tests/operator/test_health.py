"""The operator's liveness endpoint, over a real loopback socket.

Scenarios: ``GET /healthz`` answers 200 while the event loop runs; while the loop is blocked (a
synchronous call on it) the request gets no answer in time, as the kubelet's probe would not, and
the loop answers again once free; a standby that waits for the Lease answers its probe meanwhile
(``__main__._run`` serves liveness before the election), and stops serving when it ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from localcluster.cluster import free_port
from megatron_operator import __main__ as operator_main
from megatron_operator.health import HEALTH_PATH, start_health_server
from megatron_operator.settings import OperatorSettings


def _get(port: int, timeout: float) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=timeout) as response:
        return int(response.status)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on its own thread, as the operator's runs kopf."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_healthz_fails_while_the_event_loop_is_stuck(loop: asyncio.AbstractEventLoop) -> None:
    port = free_port()
    runner = asyncio.run_coroutine_threadsafe(start_health_server("127.0.0.1", port), loop).result(10)
    try:
        assert _get(port, timeout=5) == 200
        loop.call_soon_threadsafe(time.sleep, 5.0)  # a blocking call on the loop: it is stuck
        time.sleep(0.2)
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            _get(port, timeout=1.0)
        assert _get(port, timeout=10) == 200  # the loop is free again
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)


class _WaitingElector:
    """Stands in for a standby's LeaderElector: ``acquire`` waits until told, then fails."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.give_up = threading.Event()

    async def acquire(self) -> None:
        self.waiting.set()
        await asyncio.to_thread(self.give_up.wait, 30)
        raise RuntimeError("test: never leads")


def test_a_standby_answers_liveness_while_it_waits_for_the_lease() -> None:
    port = free_port()
    settings = OperatorSettings(report_host="127.0.0.1", health_port=port)
    elector = _WaitingElector()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(operator_main._run(settings, elector))  # type: ignore[arg-type]
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert elector.waiting.wait(10)
        assert _get(port, timeout=5) == 200
    finally:
        elector.give_up.set()
        thread.join(10)
    assert [str(e) for e in outcome] == ["test: never leads"]
    with pytest.raises(urllib.error.URLError):
        _get(port, timeout=2)  # the endpoint went with the loop
