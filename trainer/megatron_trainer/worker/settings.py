"""Environment of a worker process, read in one place.

Set by the agent: ``MEGATRON_JOB_SPEC`` (the full MegatronJobSpec as JSON) and
``MEGATRON_POD_NAME``. Optional, for tests and benchmarks: ``MEGATRON_WORKER_SAMPLE_LOG`` (a
directory; one rank per replica appends the sample indices of every committed step),
``MEGATRON_WORKER_COPY_LOG`` (a directory; every rank saves its buddy copies of each refresh and
its optimizer shards at the step they copy), ``MEGATRON_WORKER_COPY_TRANSPORT=gloo`` (buddy copies over
gloo even on GPU, to compare the transports; worker/buddy_copies.py),
``MEGATRON_WORKER_FAULTS`` / ``MEGATRON_WORKER_FAULT_LOG`` (see :mod:`megatron_trainer.faults`).

On GPU the worker defaults the NCCL variables in-process recovery needs (a variable already set
wins): ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the watchdog must not kill the process on an abort),
``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``, ``NCCL_NVLS_ENABLE=0`` (NVLink SHARP off, as
nvidia-resiliency-ext asks) and ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` (torch's flight-recorder dump on a
collective timeout signals every rank through the store and gathers Python stacks; the worker
handles timeouts itself, see worker/rendezvous.py). It adds :data:`PINNED_ALLOC_CONF` to
``PYTORCH_CUDA_ALLOC_CONF`` unless that already names pinned-memory options.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from megatron_contract import wire
from megatron_contract.compat import validate_ignoring_unknown
from megatron_contract.job import MegatronJobSpec

ENV_SAMPLE_LOG = "MEGATRON_WORKER_SAMPLE_LOG"
ENV_COPY_LOG = "MEGATRON_WORKER_COPY_LOG"
ENV_COPY_TRANSPORT = "MEGATRON_WORKER_COPY_TRANSPORT"
ENV_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"

#: How torch pins host memory (the buddy copies', an asynchronous save's): malloc and
#: ``cudaHostRegister`` on 8 threads rather than ``cudaHostAlloc`` on one. On 2xH100, 6 GiB were
#: pinned at 1.58 GiB/s by default and at 5.55 GiB/s so; a 1.1 B GPT's first buddy refresh (13.4 GB,
#: two generations pinned at the first two) held its step 18.8 s, then 2.9-3.5 s.
PINNED_ALLOC_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"

NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What the worker reads from its environment."""

    spec: MegatronJobSpec
    pod: str
    sample_log_dir: str | None
    copy_log_dir: str | None = None
    copies_over_gloo: bool = False  # buddy copies over gloo even where NCCL could carry them

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        """Parse the environment; a missing or malformed variable raises ValueError naming it."""
        env = os.environ if environ is None else environ
        raw = env.get(wire.ENV_JOB_SPEC)
        if not raw:
            raise ValueError(f"{wire.ENV_JOB_SPEC} is not set: the agent passes the job spec as JSON")
        try:
            # Fields this version does not know (a newer operator) were named by the agent's log.
            spec, _ = validate_ignoring_unknown(MegatronJobSpec, json.loads(raw))
        except ValueError as err:
            raise ValueError(f"{wire.ENV_JOB_SPEC} is not a valid MegatronJobSpec: {err}") from err
        pod = env.get(wire.ENV_POD_NAME)
        if not pod:
            raise ValueError(f"{wire.ENV_POD_NAME} is not set")
        transport = env.get(ENV_COPY_TRANSPORT, "")
        if transport not in ("", "gloo", "nccl"):
            raise ValueError(f"{ENV_COPY_TRANSPORT} is {transport!r}: 'gloo', or 'nccl' (the default on GPU)")
        return cls(
            spec=spec,
            pod=pod,
            sample_log_dir=env.get(ENV_SAMPLE_LOG) or None,
            copy_log_dir=env.get(ENV_COPY_LOG) or None,
            copies_over_gloo=transport == "gloo",
        )


def apply_process_defaults(environ: dict[str, str] | None = None) -> None:
    """Default the NCCL variables of in-process recovery, and add the pinned-memory options to
    torch's allocator settings unless they name some already (before torch initializes CUDA)."""
    env = os.environ if environ is None else environ
    for key, value in NCCL_DEFAULTS.items():
        env.setdefault(key, value)
    conf = env.get(ENV_ALLOC_CONF, "")
    if "pinned_" not in conf:
        env[ENV_ALLOC_CONF] = f"{conf},{PINNED_ALLOC_CONF}" if conf else PINNED_ALLOC_CONF
