"""Parameter count of a job's model, from the Megatron-Core model itself.

The model is built exactly as a worker builds it (``worker.model.transformer_config`` and
``build_gpt``, TP=PP=1) but on PyTorch's meta device, so no memory is allocated, and at depths 1
and 2: every layer has the same size, so the full count is ``P(1) + (L - 1) * (P(2) - P(1))``. A
70 B model is counted in well under a second on a laptop.

    python -m megatron_trainer.model_size --preset llama3-8b [--preset ...]

prints one JSON object per preset: ``{"preset", "numLayers", "parameters"}``; ``--model JSON``
(a small ``spec.model``) prints its extrapolated count and the count of the model built whole with
real tensors on the CPU, which the tests compare; ``--tensors JSON`` prints the element counts of its
parameter tensors in model order, ``dense`` and ``expert`` (those DDP puts in the expert-parallel
buffer), which tests compare with :mod:`megatron_contract.parameters`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from megatron_contract.job import MegatronJobSpec
from megatron_contract.presets import ModelPreset


def built_parameters(model: dict[str, Any], device: str = "meta") -> int:
    """Parameters of the model built whole on ``device`` (``cpu`` allocates them for real)."""
    from megatron_trainer.worker.model import build_gpt, transformer_config

    spec = MegatronJobSpec(image="count", replicas=1, model=model)
    with torch.device(device):
        gpt = build_gpt(spec, transformer_config(spec, torch.device("cpu"), initialize=False))
    return sum(p.numel() for p in gpt.parameters())


def built_tensors(model: dict[str, Any]) -> dict[str, list[int]]:
    """Element counts of the parameters of the model built whole on the meta device, in model order,
    split as DDP splits them: expert parameters (``allreduce`` False) and the rest."""
    from megatron_trainer.worker.model import build_gpt, transformer_config

    spec = MegatronJobSpec(image="count", replicas=1, model=model)
    with torch.device("meta"):
        gpt = build_gpt(spec, transformer_config(spec, torch.device("cpu"), initialize=False))
    out: dict[str, list[int]] = {"dense": [], "expert": []}
    for p in gpt.parameters():
        out["dense" if getattr(p, "allreduce", True) else "expert"].append(p.numel())
    return out


def count_parameters(model: dict[str, Any]) -> int:
    """Parameters of the model that ``spec.model`` = ``model`` (wire form) describes, at full depth.
    Needs Megatron's parallel state (see :func:`main`)."""
    layers = MegatronJobSpec(image="count", replicas=1, model=model).model.num_layers
    one = built_parameters({**model, "numLayers": 1})
    two = built_parameters({**model, "numLayers": 2})
    return one + (layers - 1) * (two - one)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=[p.value for p in ModelPreset], default=[])
    parser.add_argument(
        "--model", action="append", default=[], help="a spec.model as JSON; also printed built whole on the CPU"
    )
    parser.add_argument("--tensors", action="append", default=[], help="a spec.model as JSON: its tensors' sizes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        from megatron_trainer import cpu_compat

        cpu_compat.install()
    from megatron_trainer.worker import rendezvous

    rendezvous.join_spare_world(MegatronJobSpec(image="count", replicas=1), 0)  # TP=PP=1, no communicator
    for preset in args.preset:
        model = {"preset": preset}
        layers = MegatronJobSpec(image="count", replicas=1, model=model).model.num_layers
        print(json.dumps({"preset": preset, "numLayers": layers, "parameters": count_parameters(model)}), flush=True)
    for text in args.model:
        model = json.loads(text)
        counts = {"extrapolated": count_parameters(model), "cpu": built_parameters(model, "cpu")}
        print(json.dumps({"model": model, **counts}), flush=True)
    for text in args.tensors:
        print(json.dumps({"model": json.loads(text), **built_tensors(json.loads(text))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
