"""``python -m localcluster {build,up,down,status}``: the local control plane from a shell.

``up`` starts the components detached, writes ``<dir>/kubeconfig`` and returns; ``down`` stops
them from the state file in ``<dir>``. Use ``KUBECONFIG=<dir>/kubeconfig kubectl ...`` between.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from localcluster import build
from localcluster.cluster import STATE_FILE, ClusterError, LocalCluster, stop_from_state

DEFAULT_DIR = Path(".localcluster")
DEFAULT_PORT = 6443


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find cached) the pinned binaries")
    up = sub.add_parser("up", help="start a control plane and leave it running")
    up.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="state folder (default: .localcluster)")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="kube-apiserver port (default: 6443)")
    up.add_argument("--nodes", type=int, default=4, help="fake GPU nodes to register (default: 4)")
    up.add_argument("--gpus-per-node", type=int, default=8)
    up.add_argument("--no-crds", action="store_true", help="do not install crds/")
    down = sub.add_parser("down", help="stop the control plane started by `up`")
    down.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    status = sub.add_parser("status", help="say whether a control plane from `up` is running")
    status.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            for name, path in build.build_all(None).items():
                print(f"{name}\t{path}")
        elif args.command == "up":
            if (args.dir / STATE_FILE).exists():
                print(
                    f"a control plane from {args.dir} is already up; `python -m localcluster down` first",
                    file=sys.stderr,
                )
                return 1
            cluster = LocalCluster(args.dir.resolve(), apiserver_port=args.port)
            cluster.start()
            if not args.no_crds:
                cluster.install_crds()
            if args.nodes:
                cluster.add_gpu_nodes(args.nodes, gpus_per_node=args.gpus_per_node)
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.command == "down":
            if not stop_from_state(args.dir):
                print(f"no control plane is up from {args.dir}", file=sys.stderr)
                return 1
            print("stopped")
        elif args.command == "status":
            state_file = args.dir / STATE_FILE
            if not state_file.exists():
                print("down")
                return 1
            print(json.dumps(json.loads(state_file.read_text()), indent=2))
    except (ClusterError, build.BuildError) as err:
        print(f"localcluster: {err}", file=sys.stderr)
        return 1
    return 0
