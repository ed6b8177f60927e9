"""End to end, observed by a real Prometheus: Prometheus (built from its Go module) discovers the
operator and every trainer agent through Kubernetes service discovery against the local API server,
configured from the chart's own ServiceMonitor, PodMonitor and PrometheusRule. A job trains, a
worker is SIGKILLed, the spare takes over (the job uses the distributed optimizer: the lost shards
come from buddy copies on the other pod); then every panel of the chart's Grafana dashboard is
evaluated with its own PromQL and must return data without error, the series must be keyed on the
MegatronJob (not on the operator's scrape target), the alert rules must load, and the dashboard
renders to a PNG."""

from __future__ import annotations

import math
import signal
import time
from functools import partial
from pathlib import Path

import pytest
from e2e_support import (
    dump,
    job_status,
    make_elastic_job,
    process_nodes_fixture,
    submit,
    wait_for,
    wait_for_step,
)

from localcluster import dashboard
from localcluster.cluster import LocalCluster, free_port
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator
from localcluster.prometheus import RELEASE, LocalPrometheus, expose_operator, render_chart

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "observed"


process_nodes = process_nodes_fixture(3, "obs")


def test_prometheus_scrapes_the_stack_and_every_dashboard_panel_has_data(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    docs = render_chart()
    metrics_port, report_port = free_port(), free_port()

    show = partial(dump, local_cluster, namespace, log)

    with (
        LocalPrometheus(local_cluster, tmp_path / "prometheus", docs) as prom,
        running_operator(local_cluster, namespace, log, report_port, metrics_port=metrics_port),
    ):
        expose_operator(local_cluster, docs, {"metrics": metrics_port, "reports": report_port})
        start = time.time()
        job = make_elastic_job(NAME, pool="obs", train_iters=2000)
        # The optimizer real jobs use, so that the buddy copies' panels have data: its shards' copies
        # on the other pod, spaced by a cost budget; the checkpoint is its required fallback (none is
        # written in this run).
        job["spec"]["training"]["optimizer"] = {"distributed": True, "replicaCostPercent": 5}
        job["spec"]["checkpoint"] = {"path": str(tmp_path / "checkpoints"), "intervalSteps": 100_000}
        submit(local_cluster, namespace, job)
        status = wait_for_step(local_cluster, namespace, NAME, 5, 300, show)
        victim = status["plan"]["members"][0]["pod"]
        process_nodes.kill_pod_process(namespace, victim, signal.SIGKILL)
        recovered = wait_for(
            lambda: (
                (s := job_status(local_cluster, namespace, NAME)).get("epoch", 0) >= 2
                and s.get("lastRecoveryDurationSeconds") is not None
                and s
            ),
            180,
            "the recovery",
            details=show,
        )
        # A few scrapes after the recovery: the recovery histogram and the new members' steps.
        wait_for(
            lambda: prom.query(f'megatron_operator_recovery_seconds_count{{megatronjob="{NAME}"}} > 0'),
            60,
            "Prometheus to scrape the recovery",
            details=show,
        )
        resume = recovered["plan"]["resumeStep"]
        wait_for(
            lambda: prom.query(f'min(megatron_agent_step{{megatronjob="{NAME}", role="worker"}}) >= {resume + 3}'),
            120,
            "every worker's steps after the recovery in Prometheus",
            details=show,
        )
        # The new epoch's workers calibrate the copies' cost and agree on an interval; the operator
        # exports how far the copies every pod holds are behind.
        for series in ("megatron_agent_buddy_copy_interval_steps", "megatron_operator_buddy_copy_lag_steps"):
            wait_for(lambda series=series: prom.query(f'{series}{{megatronjob="{NAME}"}}'), 120, series, details=show)
        time.sleep(3)  # three more scrapes, so the range's last evaluation sees the newest samples
        end = time.time()

        targets = prom.active_targets()
        by_pool = {t["scrapePool"] for t in targets if t["health"] == "up"}
        assert any(p.startswith("serviceMonitor/") for p in by_pool), targets
        assert any(p.startswith("podMonitor/") for p in by_pool), targets

        # Operator series: keyed on the job; Prometheus' own job/namespace are the operator's target.
        [epoch] = prom.query(f'megatron_operator_plan_epoch{{megatronjob="{NAME}"}}')
        assert epoch["metric"]["megatronjob_namespace"] == namespace
        assert epoch["metric"]["job"] == RELEASE and epoch["metric"]["namespace"] != namespace
        assert float(epoch["value"][1]) >= 2
        # Agent series: the same two labels, from the PodMonitor's relabelling.
        agent_steps = prom.query(f'megatron_agent_step{{megatronjob="{NAME}", megatronjob_namespace="{namespace}"}}')
        assert {s["metric"]["role"] for s in agent_steps} >= {"worker"}, agent_steps
        assert all(s["metric"]["namespace"] == namespace for s in agent_steps)

        # Goodput in the status: the parts add up to the wall time, and steps were kept.
        goodput = job_status(local_cluster, namespace, NAME)["goodput"]
        parts = goodput["productiveSeconds"] + sum(goodput["lostSeconds"].values())
        assert abs(parts - goodput["wallSeconds"]) < 0.05 * goodput["wallSeconds"], goodput
        assert 0 < goodput["ratio"] < 1 and goodput["lostSeconds"]["reconfiguration"] > 0, goodput
        [ratio] = prom.query(f'megatron_operator_goodput_ratio{{megatronjob="{NAME}"}}')
        assert 0 < float(ratio["value"][1]) < 1

        rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
        assert len(rules) == 4 and all(r["health"] == "ok" for r in rules), rules

        panels = dashboard.evaluate(prom, start, end, namespace=namespace, job=NAME)
        queried = [p for p in panels if p.type != "row"]
        assert len(queried) == len([p for p in dashboard.load_dashboard()["panels"] if p["type"] != "row"])
        problems = [problem for p in queried for problem in p.problems]
        assert not problems, "\n".join(problems)
        for panel in queried:
            for q in panel.queries:
                assert any(math.isfinite(v) for s in q.series for v in s.values), f"{panel.title}: {q.expr}: only NaN"
        png = dashboard.render(panels, tmp_path / "dashboard.png", f"{namespace}/{NAME}", start)
        assert png.stat().st_size > 50_000
