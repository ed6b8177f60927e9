"""The operator's writes whose answers it drops unparsed, against a real kube-apiserver.

Scenario: 48 pods created at once (each True), one again (False: it exists); a pod relabelled (the
label is stored) and a pod that is gone relabelled (ignored); a pod deleted twice (the second finds
it gone); a pod the API server refuses raises ApiException with the server's own words; a job's
status written is stored. Through all of it the API client opened no more connections than it has
threads: each answer, drained, gave its connection back to the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from localcluster.cluster import LocalCluster
from megatron_contract import wire
from megatron_operator import kube
from megatronjob_builders import example_job

pytestmark = pytest.mark.cluster

PODS = 48


@pytest.fixture
def api(local_cluster: LocalCluster) -> Iterator[Any]:
    """A fresh API client of the operator's, on this cluster (restored afterwards)."""
    saved, kube._api = kube._api, None
    try:
        yield kube.configure(str(local_cluster.kubeconfig))
    finally:
        kube._api = saved


def _pod(namespace: str, name: str, cpu_request: str = "100m") -> dict[str, Any]:
    container = {"name": "c", "image": "busybox", "resources": {"requests": {"cpu": cpu_request}}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [container]},
    }


def test_writes_drop_their_answers_and_keep_their_connections(
    local_cluster: LocalCluster, namespace: str, api: Any
) -> None:
    async def scenario() -> None:
        bodies = [_pod(namespace, f"w-{i}") for i in range(PODS)]
        assert await asyncio.gather(*(kube.create_pod(b) for b in bodies)) == [True] * PODS
        assert await kube.create_pod(bodies[0]) is False
        await kube.patch_pod_labels(namespace, "w-0", {"megatron.dev/probe": "yes"})
        await kube.patch_pod_labels(namespace, "never-was", {"megatron.dev/probe": "yes"})
        await kube.delete_pod(namespace, "w-1", force=True)
        await kube.delete_pod(namespace, "w-1", force=True)
        with pytest.raises(ApiException) as refused:
            await kube.create_pod(_pod(namespace, "bad", cpu_request="lots"))
        assert refused.value.status in (400, 422)
        assert "quantities must match the regular expression" in kube.error_message(refused.value)

        status, body = local_cluster.request(
            "POST", f"/apis/{wire.GROUP}/{wire.VERSION}/namespaces/{namespace}/{wire.PLURAL}", example_job("w")
        )
        assert status == 201, body
        await kube.write_status(namespace, "w", {"phase": "Pending", "epoch": 7})

    asyncio.run(scenario())

    _, pod = local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/w-0")
    assert pod["metadata"]["labels"] == {"megatron.dev/probe": "yes"}
    assert local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/w-1")[0] == 404  # never scheduled
    _, job = local_cluster.request("GET", f"/apis/{wire.GROUP}/{wire.VERSION}/namespaces/{namespace}/{wire.PLURAL}/w")
    assert (job["status"]["phase"], job["status"]["epoch"]) == ("Pending", 7)
    opened = sum(pool.num_connections for pool in api.rest_client.pool_manager.pools._container.values())
    assert 0 < opened <= kube.API_THREADS, opened
