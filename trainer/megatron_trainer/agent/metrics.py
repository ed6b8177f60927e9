"""Prometheus metrics of one agent (one pod), in a registry of its own.

A registry per agent (not the process-global default) lets tests run several agents in one
process. The pod and job labels come from the scrape target, so the series carry none.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from megatron_contract.agent import AgentState

PREFIX = "megatron_agent"

# Recovery phases range from milliseconds (gloo re-init) to minutes (checkpoint load).
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# PhaseTimes may carry instants next to durations (e.g. ``detected_at_unix``, for a benchmark that
# knows when its fault fired); an instant is not a duration and must stay out of the histograms.
TIMESTAMP_SUFFIXES = ("_at", "_unix")


def split_phase_times(phases: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(durations, instants) of one PhaseTimes message; negative or non-finite durations are dropped."""
    durations: dict[str, float] = {}
    instants: dict[str, float] = {}
    for name, value in phases.items():
        if name.endswith(TIMESTAMP_SUFFIXES):
            instants[name] = value
        elif math.isfinite(value) and value >= 0:
            durations[name] = value
    return durations, instants


class AgentMetrics:
    """The agent's series. Names start with ``megatron_agent_``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.epoch = Gauge(f"{PREFIX}_epoch", "Epoch of the plan the agent holds (0: none).", registry=r)
        self.state = Gauge(
            f"{PREFIX}_state", "1 for the agent's current state, 0 for the others.", ["state"], registry=r
        )
        self.step = Gauge(f"{PREFIX}_step", "Last step completed by every local worker.", registry=r)
        self.consumed_samples = Gauge(f"{PREFIX}_consumed_samples", "Samples consumed by the job so far.", registry=r)
        self.loss = Gauge(f"{PREFIX}_loss", "Loss of the last completed step.", registry=r)
        self.step_time = Histogram(
            f"{PREFIX}_step_time_seconds", "Duration of a training step.", buckets=_STEP_BUCKETS, registry=r
        )
        self.last_step_time = Gauge(f"{PREFIX}_last_step_time_seconds", "Duration of the last step.", registry=r)
        self.tokens_per_second = Gauge(f"{PREFIX}_tokens_per_second", "Job throughput at the last step.", registry=r)
        self.recoveries = Counter(f"{PREFIX}_recoveries", "Reconfigurations this pod took part in.", registry=r)
        self.recovery_phase = Histogram(
            f"{PREFIX}_recovery_phase_seconds",
            "Duration of each phase of a reconfiguration (detect, abort, rendezvous, restore, first_step).",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.last_recovery_phase = Gauge(
            f"{PREFIX}_last_recovery_phase_seconds", "Phases of the last reconfiguration.", ["phase"], registry=r
        )
        self.last_recovery = Gauge(
            f"{PREFIX}_last_recovery_seconds", "Sum of the phases of the last reconfiguration.", registry=r
        )
        self.worker_restarts = Counter(f"{PREFIX}_worker_restarts", "Worker processes restarted.", registry=r)
        self.worker_kills = Counter(
            f"{PREFIX}_worker_kills", "Worker processes killed by the agent.", ["reason"], registry=r
        )
        self.worker_exits = Counter(
            f"{PREFIX}_worker_exits", "Worker processes that ended, by outcome.", ["outcome"], registry=r
        )
        self.buddy_copy_interval = Gauge(
            f"{PREFIX}_buddy_copy_interval_steps",
            "Steps between refreshes of the buddy copies: the plan's replicaIntervalSteps, or as the ranks last agreed"
            " under a cost budget (replicaCostPercent); 0 when the plan keeps no copies.",
            registry=r,
        )
        self.buddy_copy_cost = Gauge(
            f"{PREFIX}_buddy_copy_cost_ratio",
            "Share of step time the buddy copies' refreshes cost at that interval, as calibrated (under a cost"
            " budget; 0 until one is calibrated).",
            registry=r,
        )
        self.workers_alive = Gauge(f"{PREFIX}_workers_alive", "Worker processes running.", registry=r)
        self.plans = Counter(f"{PREFIX}_plans", "Plans received, by HTTP status of the answer.", ["code"], registry=r)
        self.collective_failures = Counter(
            f"{PREFIX}_collective_failures", "Collectives the workers reported failed or hung.", registry=r
        )
        self.heartbeats = Counter(f"{PREFIX}_heartbeats", "Heartbeats sent, by outcome.", ["outcome"], registry=r)
        # Known label values start at 0, so rate() and alerts see a series before the first event.
        self.worker_kills.labels(reason="hung")
        for outcome in ("succeeded", "failed", "killed"):
            self.worker_exits.labels(outcome=outcome)
        for outcome in ("ok", "error"):
            self.heartbeats.labels(outcome=outcome)
        self.set_state(AgentState.STARTING)

    def set_state(self, state: AgentState) -> None:
        """Make ``state`` the one series at 1."""
        for s in AgentState:
            self.state.labels(state=s.value).set(1.0 if s is state else 0.0)

    def observe_phases(self, phases: dict[str, float]) -> None:
        """Record one reconfiguration's phase durations (see :func:`split_phase_times`)."""
        self.recoveries.inc()
        for phase, seconds in phases.items():
            self.recovery_phase.labels(phase=phase).observe(seconds)
            self.last_recovery_phase.labels(phase=phase).set(seconds)
        self.last_recovery.set(sum(phases.values()))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
