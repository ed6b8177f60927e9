"""Benchmark: one status write of a large job, as kube-apiserver handles it.

Every status write stores the whole object, the plan included (~634 kB at 4096 pods x 8 GPUs). On a
local API server, with the CRD as generated (the plan's members kept unchecked:
``megatron_contract.crd.UNCHECKED_STATUS_FIELDS``) and, for comparison, with every field of the plan
checked against the schema, it writes a job's status ``--writes`` times the way the operator does (a
JSON patch replacing ``/status``) and prints the median and minimum time of a write. Asserts nothing
about speed; checks that the plan reads back exactly as written.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator python benchmarks/status_write.py --pods 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from operator_factories import JOB_UID, make_pod_refs, make_spec

from localcluster.cluster import LocalCluster
from localcluster.jobs import tiny_job
from megatron_contract import crd
from megatron_contract.job import MegatronJobStatus
from megatron_operator import kube
from megatron_operator.planner import plan_mesh
from megatron_operator.status import status_body

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=4096, help="worker pods of the job (8 GPUs each, TP 8)")
    parser.add_argument("--writes", type=int, default=20, help="status writes per schema")
    args = parser.parse_args()
    spec = make_spec(replicas=args.pods, min_replicas=1, spares=1, tp=8, gpus_per_pod=8)
    plan = plan_mesh(spec, JOB_UID, make_pod_refs(args.pods), [], [], None).plan
    assert plan is not None
    body = status_body(MegatronJobStatus(epoch=plan.epoch, plan=plan))
    print(f"{args.pods} pods x 8 GPUs: status of {len(json.dumps(body)) / 1e3:.0f} kB", flush=True)
    with LocalCluster(kwok=False) as cluster:
        api = kube.configure(str(cluster.kubeconfig))
        schemas = (("as generated", crd.build_crd()), ("all checked", crd.build_crd(unchecked=())))
        for i, (name, definition) in enumerate(schemas):
            path = f"{CRDS}/{crd.CRD_NAME}"
            code, current = cluster.request("GET", path)
            if code == 200:
                definition["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                code, out = cluster.request("PUT", path, definition)
            else:
                code, out = cluster.request("POST", CRDS, definition)
            assert code in (200, 201), (code, str(out)[:300])
            namespace = f"status-write-{i}"
            cluster.request(
                "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            )
            jobs = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}"
            deadline = time.monotonic() + 60
            while (code := cluster.request("POST", jobs, tiny_job("big", pool="none"))[0]) != 201:
                assert time.monotonic() < deadline, f"the job was not created: HTTP {code}"
                time.sleep(0.5)  # the changed schema is served a moment after the update
            url = f"{api.configuration.host}{jobs}/big/status"
            took = []
            for n in range(args.writes):
                data = json.dumps([{"op": "add", "path": "/status", "value": dict(body, recoveries=n)}]).encode()
                start = time.perf_counter()
                resp = api.rest_client.pool_manager.request(
                    "PATCH", url, body=data, headers={"Content-Type": "application/json-patch+json"}
                )
                took.append((time.perf_counter() - start) * 1e3)
                assert resp.status == 200, (resp.status, resp.data[:300])
            kept = json.loads(resp.data)["status"]["plan"] == body["plan"]
            print(
                f"CRD {name:12s}: status write median {statistics.median(took):4.0f} ms, min {min(took):4.0f} ms"
                f" (n={args.writes}); plan read back as written: {kept}",
                flush=True,
            )
            if not kept:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
