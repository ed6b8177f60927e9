"""A cross-field rule of the spec, written once for both doors a job comes through."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_contract.job import MegatronJobSpec


@dataclasses.dataclass(frozen=True)
class SpecRule:
    """A cross-field rule of the spec, in CEL for the API server and in Python for the operator.

    The CEL expression is scoped to ``spec`` (``self``); the message names the field.
    """

    cel: str
    message: str
    check: Callable[[MegatronJobSpec], bool]
