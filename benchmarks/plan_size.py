"""How big a MeshPlan is on the wire, and how long planning takes, for large jobs.

The plan is stored in the job's status (etcd refuses objects over ~1.5 MiB) and pushed to every
member. For each shape: the initial plan and a replacement (one pod failed, a spare promoted).
Prints figures; asserts nothing.

    PYTHONPATH=contract:operator:tests/operator python benchmarks/plan_size.py --pods 256 4096 --gpus-per-pod 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from operator_factories import JOB_UID, make_pod_refs, make_spec

from megatron_operator.planner import plan_mesh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--gpus-per-pod", type=int, default=8)
    parser.add_argument("--tp", type=int, nargs="+", default=[8, 2])
    args = parser.parse_args()
    for pods in args.pods:
        for tp in args.tp:
            gpp = args.gpus_per_pod
            per_pod = gpp // tp
            spec = make_spec(replicas=pods * per_pod, min_replicas=per_pod, spares=1, tp=tp, gpus_per_pod=gpp)
            refs = make_pod_refs(pods + 1)
            t = time.perf_counter()
            initial = plan_mesh(spec, JOB_UID, refs[:pods], [], [], None).plan
            t_initial = time.perf_counter() - t
            assert initial is not None
            t = time.perf_counter()
            replace = plan_mesh(spec, JOB_UID, refs[1:pods], [refs[pods]], [refs[0].name], initial, resume_step=10).plan
            t_replace = time.perf_counter() - t
            assert replace is not None
            size = len(json.dumps(initial.to_wire()))
            size_replace = len(json.dumps(replace.to_wire()))
            print(
                f"{pods:5d} pods x {gpp} GPUs, tp={tp}: initial plan {size / 1e3:7.0f} kB in {t_initial * 1e3:5.0f} ms;"
                f" replacement {size_replace / 1e3:7.0f} kB in {t_replace * 1e3:5.0f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
