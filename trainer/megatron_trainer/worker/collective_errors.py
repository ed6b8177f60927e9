"""Which exceptions are the epoch's failure (a peer died, hung, or the epoch was aborted) and which
are this worker's own (a bug, a bad configuration): the first make the worker report and wait for
the next plan, the second fail it loudly.
"""

from __future__ import annotations

import re

import torch.distributed as dist

from megatron_trainer.worker.step import StepAborted

#: Where gloo's TCP transport throws from. gloo's errors reach Python as a plain RuntimeError (torch
#: 2.11 types only c10d's own: NCCL errors and timeouts are DistBackendError, e.g. "NCCL communicator
#: was aborted on rank 0." from any collective after an abort, seen on an H200; store and socket
#: errors DistStoreError and DistNetworkError), so this one case is told by the source location gloo puts
#: first in its message. Measured with real gloo processes: a SIGKILLed or exited peer gives
#: "[.../gloo/transport/tcp/pair.cc:538] Read error ...: Connection reset by peer", a connection
#: shut down (abort.close_gloo_connections, or the peer freeing its groups) "[.../pair.cc:547]
#: Connection closed by peer", a stopped peer past the group timeout "[.../unbound_buffer.cc:78]
#: Timed out waiting 4000ms for recv operation to complete" (tests/trainer/test_collective_errors.py).
_GLOO_TRANSPORT_ERROR = re.compile(r"\[[^\]]*/gloo/transport/tcp/\w+\.cc:\d+\]")


def is_collective_error(err: BaseException) -> bool:
    """Whether a step's exception came from a failed or aborted collective (a peer died, hung or
    the epoch was aborted), as opposed to a bug that no reconfiguration would fix: torch's typed
    distributed errors, our own abort, and gloo's transport errors (untyped, see above). Anything
    else fails the worker loudly rather than wait for a plan that no report of its asked for."""
    if isinstance(err, StepAborted | dist.DistError):
        return True
    return type(err) is RuntimeError and _GLOO_TRANSPORT_ERROR.search(str(err)) is not None
