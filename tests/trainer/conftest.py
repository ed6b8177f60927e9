"""Fixtures shared by the trainer-agent tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_harness import RecordingOperator


@pytest.fixture
def operator() -> Iterator[RecordingOperator]:
    """A recording endpoint that plays the operator for the agents of one test."""
    recorder = RecordingOperator()
    yield recorder
    recorder.close()
