"""Hypothesis strategies shared by the planner's property tests."""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import strategies as st
from operator_factories import make_spec

from megatron_contract.job import MegatronJobSpec


@st.composite
def specs(draw: st.DrawFn, build: Callable[..., MegatronJobSpec] = make_spec) -> MegatronJobSpec:
    """A valid spec of any parallel layout (TP, PP, CP, EP, GPUs per pod) and size, made by ``build``."""
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2]))
    mp = tp * pp * cp
    layouts = [g for g in (1, 2, 4, 8) if g % tp == 0 and (mp % g == 0 or g % mp == 0)]
    gpus_per_pod = draw(st.sampled_from(layouts))
    ep = draw(st.sampled_from([1, 1, 2, 4]))
    per_pod = max(1, gpus_per_pod // mp)
    step = math.lcm(per_pod, ep)  # replicas come in whole pods and whole expert-parallel groups
    replicas = step * draw(st.integers(1, max(1, 6 // step)))
    min_replicas = step * draw(st.integers(1, replicas // step))
    moe = {"num_experts": 2 * ep, "add_bias_linear": False, "sequence_parallel": tp > 1} if ep > 1 else {}
    heads = max(4, tp * 4)
    return build(
        replicas=replicas,
        min_replicas=min_replicas,
        spares=draw(st.integers(0, 3)),
        tp=tp,
        pp=pp,
        cp=cp,
        gpus_per_pod=gpus_per_pod,
        ep=ep,
        model={"num_layers": 2 * pp, "hidden_size": heads * 16, "num_attention_heads": heads, **moe},
    )
