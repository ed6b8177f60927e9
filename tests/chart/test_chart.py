"""The Helm chart: `helm lint` passes; it renders the operator Deployment, RBAC, ServiceAccount
and Service with secure defaults (no read access to Secrets; the token key is a Secret the chart
creates, or the user's, mounted into the pod); in each namespace of jobs, a NetworkPolicy whose
selectors and port match the pods the operator builds (trainers reach each other on every port,
the operator reaches the agents' control port); every environment variable it sets is one the
operator's settings read; every value is documented with a `# --` comment; and `helm install` into
the real local control plane creates the objects (the ServiceMonitor only when enabled)."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from localcluster import build
from localcluster.cluster import LocalCluster
from megatron_contract import wire

CHART = Path(__file__).resolve().parents[2] / "charts" / "megatron-operator"


@pytest.fixture(scope="module")
def helm() -> Path:
    return build.build(build.HELM)


def render(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "mo", str(CHART), "--namespace", "megatron-system"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint(helm: Path) -> None:
    proc = subprocess.run([str(helm), "lint", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_renders_secure_operator(helm: Path) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    # The dashboard's ConfigMap is on by default (dashboard.enabled).
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
            "Deployment",
            "Service",
            "Secret",
            "ConfigMap",
        ]
    ), kinds
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert deploy["spec"]["replicas"] == 2
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in role["rules"]), "wildcard RBAC"
    # Secrets: written (each job's token Secret), never read; the token key is mounted, not fetched.
    secret_verbs = {v for r in role["rules"] if "secrets" in r["resources"] for v in r["verbs"]}
    assert secret_verbs == {"create", "patch"}, secret_verbs
    # Kueue: exactly what queueing.py and the Workload watch use (create, list/watch, delete, a status
    # patch, reading ResourceFlavors); never a write to Kueue's queues or another controller's Workloads' specs.
    kueue = {
        r: set(rule["verbs"])
        for rule in role["rules"]
        if "kueue.x-k8s.io" in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert kueue == {
        "workloads": {"create", "list", "watch", "delete"},
        "workloads/status": {"patch"},
        "resourceflavors": {"get"},
    }, kueue
    [key_secret] = [d for d in docs if d["kind"] == "Secret"]
    assert len(base64.b64decode(key_secret["data"]["key"])) >= 32
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["MEGATRON_OPERATOR_TOKEN_KEY_FILE"] == mounts["token-key"] + "/key"
    [volume] = [v for v in pod["volumes"] if v["name"] == "token-key"]
    assert volume["secret"]["secretName"] == key_secret["metadata"]["name"]
    # A Secret of the user's instead: the chart creates none and mounts that one.
    docs = render(helm, "tokenKey.existingSecret=my-key")
    assert not [d for d in docs if d["kind"] == "Secret"]
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    [volume] = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "token-key"]
    assert volume["secret"]["secretName"] == "my-key"


def test_env_names_are_the_operator_settings(helm: Path) -> None:
    from megatron_operator import settings

    known = {v for k, v in vars(settings).items() if k.startswith("ENV_") and isinstance(v, str)}
    [deploy] = [d for d in render(helm) if d["kind"] == "Deployment"]
    names = {e["name"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert names <= known, f"chart sets variables the operator does not read: {sorted(names - known)}"


def test_liveness_probe_asks_the_event_loop(helm: Path) -> None:
    """Liveness is an HTTP GET on the health port's /healthz (answered by the event loop, standbys
    included), not a TCP check; readiness is the report endpoint's /healthz (the leader's alone)."""
    [deploy] = [d for d in render(helm, "health.port=9123", "health.timeoutSeconds=4") if d["kind"] == "Deployment"]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert ports["health"] == 9123 and env["MEGATRON_OPERATOR_HEALTH_PORT"] == "9123"
    liveness, readiness = container["livenessProbe"], container["readinessProbe"]
    assert "tcpSocket" not in liveness and "tcpSocket" not in readiness
    assert liveness["httpGet"] == {"path": "/healthz", "port": "health"}
    assert liveness["timeoutSeconds"] == 4
    assert readiness["httpGet"] == {"path": "/healthz", "port": "reports"}


def test_monitoring_objects_only_when_enabled(helm: Path) -> None:
    kinds = {d["kind"] for d in render(helm)}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    docs = render(
        helm,
        "metrics.serviceMonitor.enabled=true",
        "metrics.podMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
    )
    [sm] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    [pm] = [d for d in docs if d["kind"] == "PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "agent"  # the trainer pods' named port
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert (
        "MegatronJobFailed" in alerts
        and "$labels.megatronjob" in rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]
    )


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests = {
        "In": lambda e: labels.get(e["key"]) in e["values"],
        "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
        "Exists": lambda e: e["key"] in labels,
        "DoesNotExist": lambda e: e["key"] not in labels,
    }
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def _trainer_pods() -> list[dict[str, Any]]:
    """Pods as the operator builds them: a worker and a spare, one with labels of its own."""
    from megatron_operator.builders import JobRef, build_pod
    from megatronjob_builders import small_spec

    job = JobRef("llm", "team-a", "uid-1")
    spec = small_spec(replicas=2, spares=1)
    labelled = small_spec(replicas=2, spares=1, template={"metadata": {"labels": {"team": "nlp"}}})
    return [
        build_pod(job, spec, serial=0, role=wire.ROLE_WORKER, operator_url="http://operator"),
        build_pod(job, labelled, serial=1, role=wire.ROLE_SPARE, operator_url="http://operator"),
    ]


def _container_port(pod: dict[str, Any], port: int | str) -> int:
    """The number a NetworkPolicy port (a number or a container port's name) means in ``pod``."""
    if isinstance(port, int):
        return port
    [number] = [
        p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == port
    ]
    return int(number)


def test_network_policy_admits_the_operator_to_the_agent_port_and_trainers_to_each_other(helm: Path) -> None:
    docs = render(
        helm, "watchNamespaces={team-a,team-b}", "networkPolicy.agentPortFrom[0].podSelector.matchLabels.app=prom"
    )
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    operator_labels = deploy["spec"]["template"]["metadata"]["labels"]
    pods = _trainer_pods()
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], "egress (reports to the operator, storage, DNS) is left alone"
        assert all(_selects(spec["podSelector"], pod["metadata"]["labels"]) for pod in pods)
        among, agent = spec["ingress"]
        # Trainer pods reach each other on every port: the rendezvous store, NCCL and gloo.
        assert "ports" not in among
        assert all(
            any(_selects(peer["podSelector"], pod["metadata"]["labels"]) for peer in among["from"]) for pod in pods
        )
        assert all(set(peer) == {"podSelector"} for peer in among["from"]), "peers of the pod's own namespace"
        # The operator's pods (and the peers given) reach the agents' control port, nothing else.
        for pod in pods:
            assert [(p["protocol"], _container_port(pod, p["port"])) for p in agent["ports"]] == [
                ("TCP", wire.AGENT_PORT)
            ]
        operator_peer, extra = agent["from"]
        assert operator_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "megatron-system"}}
        assert _selects(operator_peer["podSelector"], operator_labels)
        assert not _selects(operator_peer["podSelector"], pods[0]["metadata"]["labels"])
        assert extra == {"podSelector": {"matchLabels": {"app": "prom"}}}
    # Namespaces named for the policy win over the watched ones; off, or no namespace known: none.
    named = [
        d
        for d in render(helm, "watchNamespaces={team-a}", "networkPolicy.namespaces={ml}")
        if d["kind"] == "NetworkPolicy"
    ]
    assert [p["metadata"]["namespace"] for p in named] == ["ml"]
    assert not [
        d
        for d in render(helm, "watchNamespaces={team-a}", "networkPolicy.enabled=false")
        if d["kind"] == "NetworkPolicy"
    ]
    assert not [d for d in render(helm) if d["kind"] == "NetworkPolicy"]


def _exposed_metric_names() -> set[str]:
    """Every series name the operator and the trainer agent export."""
    import prometheus_client

    import megatron_operator.metrics  # noqa: F401  (registers the operator's series)
    from megatron_trainer.agent.metrics import AgentMetrics

    names: set[str] = set()
    for registry in (prometheus_client.REGISTRY, AgentMetrics().registry):
        for family in registry.collect():  # families of labelled series exist before any sample
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + suffix for suffix in suffixes}
    return names


def test_dashboard_and_alerts_use_exported_metrics(helm: Path) -> None:
    import json

    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    docs = render(helm, "metrics.prometheusRule.enabled=true")
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"megatron_(?:operator|agent)_[a-z_]+", e)}
    assert used, "no metric found in the dashboard"
    missing = used - _exposed_metric_names()
    assert not missing, f"dashboard/alerts query series nobody exports: {sorted(missing)}"
    [cm] = [d for d in render(helm) if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["megatron-operator.json"])["uid"] == "megatron-operator"


def test_every_value_is_documented() -> None:
    undocumented: list[str] = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if m:
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            documented = previous.lstrip().startswith("# --") or any(doc for _, doc in stack)
            if not documented and line.split(":", 1)[1].strip():
                undocumented.append(m.group(2))
            stack.append((indent, previous.lstrip().startswith("# --")))
        if line.strip():
            previous = line
    assert not undocumented, f"values without a `# --` comment: {undocumented}"


@pytest.mark.cluster
def test_helm_install_into_the_local_cluster(helm: Path, local_cluster: LocalCluster) -> None:
    kc = f"--kubeconfig={local_cluster.kubeconfig}"
    proc = subprocess.run(
        [
            *(str(helm), "install", "mo", str(CHART), kc, "--namespace", "megatron-system", "--create-namespace"),
            *("--set", "networkPolicy.namespaces={megatron-system}"),  # the API server accepts the policy
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = local_cluster.kubectl("get", "deploy,svc,sa", "-n", "megatron-system", "-o", "name").stdout.split()
        assert "deployment.apps/mo-megatron-operator" in got and "service/mo-megatron-operator" in got, got
        policies = local_cluster.kubectl("get", "networkpolicy", "-n", "megatron-system", "-o", "name").stdout.split()
        assert policies == ["networkpolicy.networking.k8s.io/mo-megatron-operator-trainers"], policies
        assert "Trainer pods in megatron-system accept only each other" in proc.stdout, proc.stdout  # NOTES
    finally:
        subprocess.run([str(helm), "uninstall", "mo", kc, "--namespace", "megatron-system"], capture_output=True)
