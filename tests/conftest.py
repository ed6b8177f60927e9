"""Shared fixtures: the real local control plane and per-test namespaces.

``local_cluster`` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
on loopback once per test session (the binaries are built on first use and cached outside the
clone), installs the CRDs from ``crds/`` and registers four fake GPU nodes. ``kueue`` runs Kueue's
controller manager against it, from the first test that asks for it to the end of the session.

At session finish the run fails if a process it started is still running (``leftover_processes``,
checked after these fixtures are torn down). torch's inductor cache folder, which every process that
imports megatron-core makes, is the project's cache folder's, not the temporary directory's.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from leftover_processes import pytest_sessionfinish  # noqa: F401 - the session-end check, a hook
from localcluster.cluster import LocalCluster
from localcluster.kueue import KueueManager

# `import megatron.core` makes torch's inductor cache folder, by default in the temporary directory:
# every trainer process of the suite (this one too, at collection) would leave /tmp/torchinductor_<user>.
# It goes to the project's cache folder instead, beside the venv, unless the caller chose one.
_CACHE = Path(os.environ.get("MEGATRON_OPERATOR_CACHE", Path.home() / ".cache" / "megatron-operator"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "torchinductor"))


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster()
    cluster.start()
    try:
        cluster.install_crds()
        cluster.add_gpu_nodes(4, gpus_per_node=8)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def kueue(local_cluster: LocalCluster) -> Iterator[KueueManager]:
    """Kueue's controller manager (built from its Go module on first use) against the session's
    cluster, for the rest of the session once a test asks for it; its CRDs stay installed."""
    manager = KueueManager(local_cluster).start()
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture(scope="session")
def kubeconfig(local_cluster: LocalCluster) -> Path:
    return local_cluster.kubeconfig


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    status, body = local_cluster.request(
        "POST",
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "annotations": {"megatron.dev/test": request.node.nodeid}},
        },
    )
    assert status == 201, f"could not create namespace {name}: {status} {json.dumps(body)[:500]}"
    yield name
    local_cluster.request("DELETE", f"/api/v1/namespaces/{name}")
