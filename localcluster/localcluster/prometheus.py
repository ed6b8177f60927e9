"""A real Prometheus on the local control plane, configured from the chart's own monitoring objects.

The chart tells a Prometheus operator what to scrape with a ServiceMonitor (the operator's metrics
port) and a PodMonitor (every trainer pod's agent), and what to alert on with a PrometheusRule.
There is no Prometheus operator here, so :func:`scrape_configs` translates those objects into the
scrape configuration the Prometheus operator would generate for them (Kubernetes service discovery
against the local API server, the same keep/relabel rules), and :func:`rule_groups` takes the
rules as they are. Prometheus and promtool are built from their Go module and cached like the
control plane (:mod:`localcluster.build`).

The operator runs as a host process, not as the chart's Deployment, so :func:`expose_operator`
gives it what the chart would: the chart's Service, pointed at the process by an EndpointSlice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from localcluster import build
from localcluster.cluster import LocalCluster, free_port
from localcluster.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "megatron-operator"
#: The release name and namespace the chart is rendered with (the operator's Service lives there).
RELEASE = "megatron-operator"
OPERATOR_NAMESPACE = "megatron-system"
#: Values that turn the chart's monitoring objects on.
MONITORING_VALUES = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
)


class PrometheusError(RuntimeError):
    """Prometheus failed to start, or a query failed (the message has Prometheus' error)."""


def render_chart(*sets: str, namespace: str = OPERATOR_NAMESPACE) -> list[dict[str, Any]]:
    """The chart's objects as ``helm template`` renders them with the monitoring objects on."""
    helm = build.build(build.HELM)
    args = [str(helm), "template", RELEASE, str(CHART), "--namespace", namespace]
    for value in (*MONITORING_VALUES, *sets):
        args += ["--set", value]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PrometheusError(f"helm template failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _sanitize(label: str) -> str:
    """A Kubernetes label name as Prometheus' service discovery spells it in meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _namespaces(monitor: dict[str, Any]) -> dict[str, Any]:
    """The ``namespaces`` of a discovery config from a monitor's namespaceSelector (own namespace by default)."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return {}
    names = selector.get("matchNames") or [monitor["metadata"]["namespace"]]
    return {"namespaces": {"names": list(names)}}


def _relabelings(endpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """An endpoint's relabelings, from the CRD's camelCase to Prometheus' snake_case."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(k, k): v for k, v in r.items()} for r in endpoint.get("relabelings") or []]


def _selector_keeps(meta: str, selector: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep rules for a label selector (matchLabels, and matchExpressions with Exists/In)."""
    rules: list[dict[str, Any]] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        rules.append(
            {
                "action": "keep",
                "source_labels": [f"{meta}_label_{_sanitize(key)}", f"{meta}_labelpresent_{_sanitize(key)}"],
                "regex": f"({re.escape(value)});true",
            }
        )
    for expr in selector.get("matchExpressions") or []:
        key, op = _sanitize(expr["key"]), expr["operator"]
        if op == "Exists":
            rules.append({"action": "keep", "source_labels": [f"{meta}_labelpresent_{key}"], "regex": "true"})
        elif op == "In":
            values = "|".join(re.escape(v) for v in expr["values"])
            rules.append({"action": "keep", "source_labels": [f"{meta}_label_{key}"], "regex": f"({values})"})
        else:
            raise PrometheusError(f"selector operator {op} is not translated; use Exists or In")
    return rules


def _service_monitor(monitor: dict[str, Any], sd: dict[str, Any], interval: str) -> list[dict[str, Any]]:
    ns, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    configs = []
    for i, endpoint in enumerate(monitor["spec"]["endpoints"]):
        relabel = [
            *_selector_keeps("__meta_kubernetes_service", monitor["spec"]["selector"]),
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_endpointslice_port_name"],
                "regex": endpoint["port"],
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
            *_relabelings(endpoint),
        ]
        configs.append(
            {
                "job_name": f"serviceMonitor/{ns}/{name}/{i}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "scrape_interval": interval,
                "metrics_path": endpoint.get("path", "/metrics"),
                "kubernetes_sd_configs": [{**sd, "role": "endpointslice", **_namespaces(monitor)}],
                "relabel_configs": relabel,
            }
        )
    return configs


def _pod_monitor(monitor: dict[str, Any], sd: dict[str, Any], interval: str) -> list[dict[str, Any]]:
    ns, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    configs = []
    for i, endpoint in enumerate(monitor["spec"]["podMetricsEndpoints"]):
        relabel = [
            *_selector_keeps("__meta_kubernetes_pod", monitor["spec"]["selector"]),
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": endpoint["port"],
            },
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            *[
                {"source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(k)}"], "target_label": _sanitize(k)}
                for k in monitor["spec"].get("podTargetLabels") or []
            ],
            {"target_label": "job", "replacement": f"{ns}/{name}"},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
            *_relabelings(endpoint),
        ]
        configs.append(
            {
                "job_name": f"podMonitor/{ns}/{name}/{i}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "scrape_interval": interval,
                "metrics_path": endpoint.get("path", "/metrics"),
                "kubernetes_sd_configs": [{**sd, "role": "pod", **_namespaces(monitor)}],
                "relabel_configs": relabel,
            }
        )
    return configs


def scrape_configs(docs: list[dict[str, Any]], kubeconfig: Path, interval: str = "1s") -> list[dict[str, Any]]:
    """Scrape configs for every ServiceMonitor and PodMonitor in ``docs``, discovering through ``kubeconfig``.

    ``interval`` replaces the monitors' own (15 s by default in the chart) so that short runs have
    enough samples.
    """
    sd = {"kubeconfig_file": str(kubeconfig)}
    configs: list[dict[str, Any]] = []
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            configs += _service_monitor(doc, sd, interval)
        elif doc["kind"] == "PodMonitor":
            configs += _pod_monitor(doc, sd, interval)
    if not configs:
        raise PrometheusError("the chart rendered no ServiceMonitor or PodMonitor")
    return configs


def rule_groups(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rule groups of every PrometheusRule in ``docs``, as a Prometheus rules file."""
    groups = [g for doc in docs if doc["kind"] == "PrometheusRule" for g in doc["spec"]["groups"]]
    if not groups:
        raise PrometheusError("the chart rendered no PrometheusRule")
    return {"groups": groups}


def expose_operator(cluster: LocalCluster, docs: list[dict[str, Any]], ports: dict[str, int]) -> None:
    """Create the chart's operator Service, without its selector, and an EndpointSlice pointing its
    ports (by name, e.g. ``{"metrics": 9100, "reports": 29500}``) at the operator process on this host.

    The slice names this host's address: the API server refuses loopback addresses in endpoints.
    """
    [service] = [d for d in docs if d["kind"] == "Service"]
    ns, name = service["metadata"]["namespace"], service["metadata"]["name"]
    _ensure_namespace(cluster, ns)
    service = json.loads(json.dumps(service))
    service["spec"].pop("selector", None)
    for port in service["spec"]["ports"]:
        port["targetPort"] = ports[port["name"]]
    _create_or_replace(cluster, f"/api/v1/namespaces/{ns}/services", service)
    endpoint_slice = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-local",
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": name, "endpointslice.kubernetes.io/managed-by": "localcluster"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [host_address()], "conditions": {"ready": True}}],
        "ports": [{"name": p["name"], "port": ports[p["name"]], "protocol": "TCP"} for p in service["spec"]["ports"]],
    }
    _create_or_replace(cluster, f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", endpoint_slice)


def host_address() -> str:
    """This host's first non-loopback IPv4 address (where a process listening on 0.0.0.0 is reachable)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = str(probe.getsockname()[0])
        if not address.startswith("127."):
            return address
    for address in socket.gethostbyname_ex(socket.gethostname())[2]:
        if not address.startswith("127."):
            return address
    raise PrometheusError("this host has no non-loopback IPv4 address for the operator's EndpointSlice")


def _ensure_namespace(cluster: LocalCluster, name: str) -> None:
    status, body = cluster.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    if status not in (201, 409):
        raise PrometheusError(f"could not create namespace {name}: {status} {body}")


def _create_or_replace(cluster: LocalCluster, collection: str, obj: dict[str, Any]) -> None:
    status, body = cluster.request("POST", collection, obj)
    if status == 409:
        cluster.request("DELETE", f"{collection}/{obj['metadata']['name']}")
        status, body = cluster.request("POST", collection, obj)
    if status != 201:
        raise PrometheusError(f"could not create {obj['kind']} {obj['metadata']['name']}: {status} {body}")


class PrometheusClient:
    """The HTTP API of a running Prometheus at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a success, :class:`PrometheusError` otherwise."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        except OSError as err:
            raise PrometheusError(f"{path}: {err}") from err
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (or scalar as a one-element list)."""
        data = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        return (
            data["result"] if data["resultType"] in ("vector", "matrix") else [{"metric": {}, "value": data["result"]}]
        )

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])


class LocalPrometheus(PrometheusClient):
    """A Prometheus process scraping the local cluster's operator and trainer pods.

    Args:
        cluster: the running local control plane (Prometheus discovers targets through its API).
        workdir: where the configuration, rules, TSDB and log go.
        docs: the chart's rendered objects (:func:`render_chart`).
        interval: scrape and rule evaluation interval.
    """

    def __init__(self, cluster: LocalCluster, workdir: Path, docs: list[dict[str, Any]], interval: str = "1s") -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.log = self.workdir / "prometheus.log"
        self._config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": ["rules.yaml"],
            "scrape_configs": scrape_configs(docs, cluster.kubeconfig, interval),
        }
        self._rules = rule_groups(docs)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        binary = build.build(build.PROMETHEUS)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A fresh TSDB: an earlier run's series would stay visible for Prometheus' 5-minute lookback.
        shutil.rmtree(self.workdir / "tsdb", ignore_errors=True)
        (self.workdir / "prometheus.yaml").write_text(yaml.safe_dump(self._config, sort_keys=False))
        (self.workdir / "rules.yaml").write_text(yaml.safe_dump(self._rules, sort_keys=False))
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                [
                    str(binary),
                    f"--config.file={self.workdir / 'prometheus.yaml'}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                cwd=self.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self._proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {proc.returncode}; log: {self.log}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
            return False

        try:
            wait_for(
                ready,
                timeout,
                "prometheus to be ready",
                interval=0.3,
                error=PrometheusError,
                details=lambda: f"log: {self.log}",
            )
        except PrometheusError:  # exited, or not ready in time
            self.stop()
            raise

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_prometheus(
    cluster: LocalCluster, workdir: Path | None = None, interval: str = "1s"
) -> Iterator[LocalPrometheus]:
    """Start Prometheus over ``cluster`` configured from the chart; stop it (and its process group) on exit."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prometheus-")))
        prom = LocalPrometheus(cluster, workdir, render_chart(), interval)
        stack.enter_context(prom)
        yield prom
