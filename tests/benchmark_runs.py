"""Running a benchmark script from a test: the scripts in ``benchmarks/`` are checked at a small
size (on CPU processes with gloo, or on GPUs where there are some) through the JSON they write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str, cpu: bool = False, timeout: float = 540) -> Any:
    """Run ``benchmarks/<script>`` with ``args`` and ``--out out``; fail with its output when it
    fails; return what it wrote. ``cpu`` hides any GPU (gloo processes).

    The benchmark's temporary files (the work folders it keeps for a reader, those of the processes it
    kills) go beside ``out`` (in pytest's ``tmp_path``, which pytest prunes), not into ``/tmp``."""
    tmp = out.parent / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "TMPDIR": str(tmp),
        **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}),
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())
