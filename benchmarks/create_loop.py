"""Benchmark: how many pods the operator creates (or tries to) while every one of them fails.

Starts the local control plane with kwok fake GPU nodes and the operator as a real process, then
for ``--seconds`` each:

- crashing spares: a job of one worker and one spare; every new spare is marked Failed as soon as
  it runs (a trainer that exits at start), and the first spare too; counts the pods created;
- refused creates: a job whose pods the API server refuses (cpu requests above limits); counts
  the create attempts (pod names reserved on the job, three per attempt).

Prints figures; asserts nothing. Without the backoff the first case made about 134 pods in 26 s.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/create_loop.py --seconds 26
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

from operator_harness import Harness  # noqa: E402

from localcluster.cluster import LocalCluster  # noqa: E402
from localcluster.waiting import wait_for  # noqa: E402
from megatron_operator.builders import ANNOTATION_NEXT_SERIAL  # noqa: E402


def _namespace(cluster: LocalCluster) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    code, body = cluster.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    assert code == 201, body
    return name


def _serials(h: Harness) -> int:
    return int((h.api.job(h.job)["metadata"].get("annotations") or {}).get(ANNOTATION_NEXT_SERIAL, "0"))


def crashing_spares(cluster: LocalCluster, tmp: Path, seconds: float) -> dict[str, Any]:
    (tmp / "crash").mkdir()
    h = Harness(cluster, _namespace(cluster), tmp / "crash", "crash")
    try:
        h.add_nodes(1)
        h.start_operator()
        h.submit(replicas=1, spares=1, min_replicas=1)
        status = wait_for(lambda: (s := h.api.status("crash")).get("phase") == "Running" and s, 60, "Running")
        members = set(h.members(status))
        crashed: set[str] = set()
        stop = threading.Event()

        def crash() -> None:
            while not stop.wait(0.05):
                for pod in h.api.running_pods("crash"):
                    name = pod["metadata"]["name"]
                    if name not in members and name not in crashed:
                        h.api.patch_pod_status(name, {"phase": "Failed", "reason": "Error"})
                        crashed.add(name)

        before = _serials(h)
        thread = threading.Thread(target=crash, daemon=True)
        thread.start()
        time.sleep(seconds)  # the measurement window itself, not a synchronisation
        stop.set()
        thread.join(5)
        return {"pods created": _serials(h) - before, "spares crashed": len(crashed)}
    finally:
        h.close(failed=False)


def refused_creates(cluster: LocalCluster, tmp: Path, seconds: float) -> dict[str, Any]:
    (tmp / "refused").mkdir()
    h = Harness(cluster, _namespace(cluster), tmp / "refused", "refused")
    try:
        h.add_nodes(1)
        h.start_operator()
        h.submit(replicas=2, spares=1, min_replicas=1, resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}})
        time.sleep(seconds)  # the measurement window itself, not a synchronisation
        conditions = {c["type"]: c for c in h.api.status("refused").get("conditions", [])}
        return {
            "create attempts": _serials(h) // 3,
            "CreateFailed": (conditions.get("CreateFailed") or {}).get("message", "")[:160],
        }
    finally:
        h.close(failed=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=26.0, help="length of each measurement window")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster()
        cluster.start()
        try:
            cluster.install_crds()
            for name, run in (("crashing spares", crashing_spares), ("refused creates", refused_creates)):
                print(f"{name} over {args.seconds:.0f} s: {run(cluster, Path(tmp), args.seconds)}", flush=True)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
