"""The pod's rendezvous store: a torch TCPStore server bound to the pod address.

Every agent hosts one for its whole life, and plans name the store of a surviving member pod;
workers only ever connect as clients, each epoch under its own key prefix (a worker must never
host the store: it may die, a TCPStore port cannot be re-bound while its server object lives, and
old clients never reconnect).

TCPStore binds its own listening socket to every interface, which would stop several agents on
one machine (tests, the local cluster's loopback pod IPs) from using the standard port. So the
agent binds the socket itself, to the pod address only, and hands it over with
``master_listen_fd`` (supported by the libuv backend).

torch is imported here only, lazily: the rest of the agent stays torch-free and starts fast.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from typing import Any

log = logging.getLogger(__name__)


class RendezvousHost:
    """A TCPStore server on ``(address, port)``; :meth:`start` blocks for the torch import."""

    def __init__(self, address: str, port: int) -> None:
        self.address = address
        self.port = port
        self._store: Any = None

    @property
    def running(self) -> bool:
        """Whether the store server is up."""
        return self._store is not None

    def start(self) -> None:
        """Bind the port and start the server (a few seconds: most of it is ``import torch``).

        Raises:
            OSError: when the address/port cannot be bound (another store, a stale process).
        """
        started = time.monotonic()
        listener = socket.socket(socket.AF_INET6 if ":" in self.address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.address, self.port))
            listener.listen(1024)
            self.port = listener.getsockname()[1]  # resolves port 0 (tests)
            import torch.distributed as dist  # the one torch import of the agent

            self._store = dist.TCPStore(
                self.address,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
                master_listen_fd=listener.fileno(),
                use_libuv=True,
            )
        except BaseException:
            listener.close()
            raise
        # The store's event loop owns the descriptor from here on; closing the Python socket
        # under it makes the server's poll fail and abort the process.
        listener.detach()
        log.info("rendezvous store listening on %s:%d (%.1f s)", self.address, self.port, time.monotonic() - started)

    def stop(self) -> None:
        """Drop the server (the port is released when the process exits)."""
        self._store = None
