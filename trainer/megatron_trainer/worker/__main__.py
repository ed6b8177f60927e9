"""``python -m megatron_trainer.worker --channel-fd FD --local-rank I``: one training worker.

The agent spawns it with one end of a socketpair (see :mod:`megatron_trainer.channel`) and the
environment described in :mod:`megatron_trainer.worker.settings`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import traceback
from pathlib import Path

from megatron_trainer.worker.settings import WorkerSettings, apply_process_defaults


def failure_detail(err: BaseException) -> str:
    """What the worker reports when it fails: the error and where it was raised (the whole
    traceback goes to the log)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(err).__name__}{where}: {err}"[:1000]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and environment, then run the worker until shutdown."""
    parser = argparse.ArgumentParser(prog="python -m megatron_trainer.worker", description=__doc__)
    parser.add_argument("--channel-fd", type=int, required=True, help="file descriptor of the agent channel")
    parser.add_argument("--local-rank", type=int, required=True, help="index of this worker in its pod")
    args = parser.parse_args(argv)
    if args.local_rank < 0:
        parser.error("--local-rank must be >= 0")
    try:
        settings = WorkerSettings.from_env()
    except ValueError as err:
        parser.error(str(err))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s worker {settings.pod}/{args.local_rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)  # megatron logs its whole config at INFO
    apply_process_defaults()  # before torch touches CUDA or NCCL

    import warnings

    warnings.filterwarnings("ignore", module="megatron")  # fallbacks for absent TE/Apex, once per import
    from megatron_trainer.channel import Channel, WorkerStatus
    from megatron_trainer.worker.runtime import Worker

    channel = Channel.from_fd(args.channel_fd)
    worker = Worker(channel, args.local_rank, settings)
    try:
        return worker.run()
    except Exception as err:
        logging.getLogger("megatron_trainer.worker").exception("worker failed")
        detail = failure_detail(err)
        with contextlib.suppress(OSError):
            channel.send(WorkerStatus(state="failed", epoch=worker.epoch, detail=detail))
        return 1


if __name__ == "__main__":
    sys.exit(main())
