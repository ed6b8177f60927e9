"""Kueue's own controller manager against the local control plane.

Kueue (built from its Go module at the pinned version, :data:`build.KUEUE`) runs as a local process
in its own session, like the control plane's components, with:

- its CRDs from the same module version (kept next to the binary by the build). Kueue 0.15's
  manager speaks ``v1beta2`` while the CRDs store ``v1beta1``, so the API server converts through
  Kueue's own conversion webhook, as in a real installation: the CRDs are installed with the webhook's
  URL on loopback and the cluster's CA. No admission (validating or mutating) webhook is registered
  with the API server: Kueue's defaulting and validation of our Workloads do not run, so the
  operator writes complete Workloads.
- its webhook server on a free loopback port, serving a certificate signed by the cluster's CA
  (internal cert management off: that needs a kubelet to mount the certificate's Secret);
- leader election off, its metrics and health probes on free loopback ports, the visibility API
  server off (it listens on a fixed port), and the integrations a MegatronJob needs: ``batch/job``
  (Kueue refuses an empty list) and the MegatronJob as an external framework, whose Workloads the
  operator creates itself.

With internal cert management off, Kueue 0.15 reads its metrics server's certificate from the fixed
path ``/etc/kueue/metrics/certs``: a self-signed pair is written there when missing (it secures only
the metrics endpoint, which the tests do not scrape).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from localcluster import build, certs
from localcluster.cluster import ClusterError, LocalCluster, _terminate, free_port
from localcluster.waiting import wait_for

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
NAMESPACE = "kueue-system"
#: Where Kueue 0.15 reads its metrics certificate when its internal cert management is off.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
#: The MegatronJob as Kueue names an external framework: Kind.version.group.
MEGATRONJOB_FRAMEWORK = "MegatronJob.v1alpha1.megatron.dev"
#: CRDs whose versions differ in schema: the API server converts them through Kueue's webhook.
_CONVERTED = ("workloads", "clusterqueues", "localqueues", "cohorts", "multikueueclusters")


class KueueManager:
    """Kueue's controller manager for one local cluster; ``stop()`` ends it (and its session)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.workdir = cluster.workdir / "kueue"
        self.proc: subprocess.Popen[bytes] | None = None
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.metrics_port = free_port()

    @property
    def log_path(self) -> Path:
        return self.workdir / "kueue.log"

    def start(self, timeout: float = 120.0) -> KueueManager:
        """Build Kueue (first run only), install its CRDs, start its manager and wait until it is ready.

        Raises:
            ClusterError: the build failed, or the manager died or was not ready in time (its log's tail).
        """
        try:
            binary = build.build(build.KUEUE)
        except build.BuildError as err:
            raise ClusterError(str(err)) from err
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        pki = self.cluster._pki()
        crt, key = certs.serving_cert(pki, "kueue-webhook")
        cert_dir = self.workdir / "certs"
        cert_dir.mkdir()
        shutil.copy(crt, cert_dir / "tls.crt")
        shutil.copy(key, cert_dir / "tls.key")
        _ensure_metrics_cert(crt, key)
        self._install_crds(pki.ca_crt, timeout)
        self.cluster.kubectl("create", "namespace", NAMESPACE, check=False)
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump(self._config(cert_dir)))
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                str(binary),
                f"--config={config}",
                f"--kubeconfig={self.cluster.kubeconfig}",
                # A fixed port, the same in every cluster: off.
                "--feature-gates=VisibilityOnDemand=false",
                "--zap-log-level=2",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.workdir,
        )
        log.close()
        try:
            wait_for(
                self._ready, timeout, "Kueue's manager ready", interval=0.25, error=ClusterError, details=self.log_tail
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM (then SIGKILL) the manager's process group; idempotent."""
        if self.proc is not None:
            _terminate(self.proc.pid, "kueue")
            self.proc = None

    def __enter__(self) -> KueueManager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise ClusterError(f"Kueue's manager exited:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _config(self, cert_dir: Path) -> dict[str, Any]:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(cert_dir)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [MEGATRONJOB_FRAMEWORK]},
        }

    def _install_crds(self, ca_crt: Path, timeout: float) -> None:
        """The module's CRDs, the converted ones pointed at this manager's webhook by URL."""
        source = build.files_path(build.KUEUE)
        out = self.workdir / "crds"
        out.mkdir()
        bundle = base64.b64encode(ca_crt.read_bytes()).decode()
        for f in sorted(source.glob("*.yaml")):
            crd = yaml.safe_load(f.read_text())
            if crd["spec"]["names"]["plural"] in _CONVERTED:
                crd["spec"]["conversion"] = {
                    "strategy": "Webhook",
                    "webhook": {
                        "conversionReviewVersions": ["v1"],
                        "clientConfig": {"url": f"https://127.0.0.1:{self.webhook_port}/convert", "caBundle": bundle},
                    },
                }
            (out / f.name).write_text(yaml.safe_dump(crd))
        self.cluster.install_crds(out, timeout)


def _ensure_metrics_cert(crt: Path, key: Path) -> None:
    """Kueue's fixed metrics-certificate path: a pair is written when there is none (atomically,
    as another local cluster may be starting Kueue at the same time)."""
    if (METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists():
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for source, name in ((crt, "tls.crt"), (key, "tls.key")):
            fd, tmp = tempfile.mkstemp(dir=METRICS_CERT_DIR)
            with os.fdopen(fd, "wb") as out:
                out.write(source.read_bytes())
            os.replace(tmp, METRICS_CERT_DIR / name)
    except OSError as exc:
        raise ClusterError(
            f"Kueue {build.KUEUE_VERSION} reads its metrics certificate from {METRICS_CERT_DIR} when its internal "
            f"cert management is off, and it cannot be written here ({exc}); create it once, e.g. "
            f"`sudo mkdir -p {METRICS_CERT_DIR} && sudo cp {crt} {METRICS_CERT_DIR}/tls.crt && "
            f"sudo cp {key} {METRICS_CERT_DIR}/tls.key && sudo chmod a+r {METRICS_CERT_DIR}/*`"
        ) from exc


def apply(cluster: LocalCluster, *objects: dict[str, Any]) -> None:
    """Server-side apply Kueue objects (ResourceFlavor, ClusterQueue, LocalQueue, ...)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(list(objects)))


def resource_flavor(name: str, node_labels: dict[str, str]) -> dict[str, Any]:
    """A ResourceFlavor whose nodes carry ``node_labels`` (Kueue hands them on as node selectors)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": {"nodeLabels": node_labels},
    }


def cluster_queue(name: str, flavor: str, gpus: int, *, preempt: bool = False) -> dict[str, Any]:
    """A ClusterQueue with ``gpus`` of nvidia.com/gpu (and ample cpu and memory) in ``flavor``;
    ``preempt``: a higher-priority Workload may preempt lower ones in the queue."""
    spec: dict[str, Any] = {
        "namespaceSelector": {},
        "resourceGroups": [
            {
                "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                "flavors": [
                    {
                        "name": flavor,
                        "resources": [
                            {"name": "cpu", "nominalQuota": "1000"},
                            {"name": "memory", "nominalQuota": "10Ti"},
                            {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                        ],
                    }
                ],
            }
        ],
    }
    if preempt:
        spec["preemption"] = {"withinClusterQueue": "LowerPriority"}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LocalQueue",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"clusterQueue": cluster_queue_name},
    }
