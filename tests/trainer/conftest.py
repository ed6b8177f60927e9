"""Fixtures shared by the trainer's tests: the operator's endpoint for the agents, and the worker
clusters of one test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import RecordingOperator
from worker_harness import MakeCluster, WorkerCluster

from megatron_contract.job import MegatronJobSpec


@pytest.fixture
def operator() -> Iterator[RecordingOperator]:
    """A recording endpoint that plays the operator for the agents of one test."""
    recorder = RecordingOperator()
    yield recorder
    recorder.close()


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    """Makes the worker clusters of one test (``WorkerCluster``'s arguments) and shuts them down
    afterwards, printing their logs (pytest shows them when the test failed)."""
    made: list[WorkerCluster] = []

    def make(spec: MegatronJobSpec, workdir: Path, extra_env: dict[str, str] | None = None) -> WorkerCluster:
        cluster = WorkerCluster(spec, workdir, extra_env)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        print(cluster.logs())
        cluster.close()
