"""Run the real operator (``python -m megatron_operator``) as a subprocess against a local cluster."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from localcluster.cluster import LocalCluster, free_port

#: The operator's token key (MEGATRON_OPERATOR_TOKEN_KEY_FILE), one per local cluster.
TOKEN_KEY_FILE = "operator-token-key"


def token_key_file(workdir: Path) -> Path:
    """The operator's token key in ``workdir``, created (mode 0600, 64 random characters) on first use.

    One key per cluster, so every operator process started against it (a restart, a standby)
    derives the same job tokens, as replicas of an installed chart do from the chart's Secret.
    Creation is exclusive: processes racing to create it end with the same key.
    """
    path = Path(workdir) / TOKEN_KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(48))
    return path


class OperatorProcess:
    """The operator as a subprocess that can be killed and started again on the same ports (a
    chaos run's "operator restart"); :func:`running_operator` is the usual way to hold one."""

    def __init__(
        self,
        cluster: LocalCluster,
        namespaces: str,
        log: Path,
        port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.env = {
            **os.environ,
            "KUBECONFIG": str(cluster.kubeconfig),
            "MEGATRON_OPERATOR_NAMESPACES": namespaces,
            "MEGATRON_OPERATOR_URL": self.url,
            "MEGATRON_OPERATOR_REPORT_HOST": "127.0.0.1",
            "MEGATRON_OPERATOR_REPORT_PORT": str(self.port),
            "MEGATRON_OPERATOR_LEADER_ELECTION": "false",
            "MEGATRON_OPERATOR_TOKEN_KEY_FILE": str(token_key_file(cluster.workdir)),
        }
        if metrics_port is not None:
            self.env["MEGATRON_OPERATOR_METRICS_PORT"] = str(metrics_port)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "megatron_operator"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def kill(self) -> None:
        """SIGKILL, as a crashed or evicted operator pod: no shutdown of any kind."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), SIGKILL after 15 s."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@contextmanager
def running_operator(
    cluster: LocalCluster, namespaces: str, log: Path, port: int | None = None, metrics_port: int | None = None
) -> Iterator[str]:
    """Run the operator for ``namespaces`` (comma-separated; all when empty), its output in ``log``.

    Yields the URL that trainer agents report to (``port`` on loopback, a free one by default: an
    operator restarted under the pods of a job must use the one they know, as a Service would).
    Leader election is off: there is one replica. With ``metrics_port`` it serves its Prometheus
    metrics there (on every address, as in a pod; see :func:`localcluster.prometheus.expose_operator`).
    """
    operator = OperatorProcess(cluster, namespaces, log, port, metrics_port).start()
    try:
        yield operator.url
    finally:
        operator.stop()
