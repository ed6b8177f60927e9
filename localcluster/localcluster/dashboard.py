"""Evaluate the chart's Grafana dashboard against a Prometheus and render it to a PNG.

Every panel's own PromQL is run, with the dashboard's variables substituted the way Grafana does
(``$namespace`` and ``$job`` as regular expressions, ``$__rate_interval``, ``$__range``), over a
time range: range queries for time series, an instant query at the end for tables and bar charts.
The picture is laid out on the dashboard's own 24-column grid (matplotlib, no Grafana needed).

    python -m localcluster.dashboard --prometheus http://127.0.0.1:9090 --minutes 10 --out dashboard.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from localcluster.prometheus import CHART, PrometheusClient, PrometheusError

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
_INSTANT_PANELS = ("table", "barchart", "stat", "bargauge")


@dataclasses.dataclass
class Series:
    labels: dict[str, str]
    times: list[float]
    values: list[float]


@dataclasses.dataclass
class QueryResult:
    expr: str
    legend: str
    series: list[Series]
    error: str | None = None

    def name(self, series: Series) -> str:
        """The legend of one series: the target's legendFormat with ``{{label}}`` filled in."""
        if not self.legend:
            return ",".join(f"{k}={v}" for k, v in sorted(series.labels.items())) or self.expr
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: series.labels.get(m.group(1), ""), self.legend)


@dataclasses.dataclass
class PanelResult:
    title: str
    type: str
    grid: dict[str, int]
    queries: list[QueryResult]

    @property
    def problems(self) -> list[str]:
        """Queries that failed or returned no series."""
        out = []
        for q in self.queries:
            if q.error:
                out.append(f"{self.title!r}: {q.expr}: {q.error}")
            elif not q.series:
                out.append(f"{self.title!r}: {q.expr}: no series")
        return out


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with ``$name`` and ``${name}`` replaced, longest names first (``$__range`` before ``$__r``)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


def evaluate(
    prom: PrometheusClient,
    start: float,
    end: float,
    *,
    namespace: str = ".*",
    job: str = ".*",
    scrape_interval: float = 1.0,
    dashboard: dict[str, Any] | None = None,
) -> list[PanelResult]:
    """Run every panel's queries over ``[start, end]`` (Unix seconds); rows come back with no queries."""
    dashboard = dashboard or load_dashboard()
    step = max(scrape_interval, round((end - start) / 240, 1))
    variables = {
        "namespace": namespace,
        "job": job,
        # Grafana: max($__interval + scrape interval, 4 * scrape interval).
        "__rate_interval": f"{round(max(step + scrape_interval, 4 * scrape_interval) * 1000)}ms",
        "__range": f"{max(1, round(end - start))}s",
    }
    results = []
    for panel in dashboard["panels"]:
        queries = []
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], variables)
            legend = target.get("legendFormat", "")
            try:
                if panel["type"] in _INSTANT_PANELS:
                    raw = prom.query(expr, at=end)
                    series = [Series(r["metric"], [float(r["value"][0])], [float(r["value"][1])]) for r in raw]
                else:
                    raw = prom.query_range(expr, start, end, step)
                    series = [
                        Series(r["metric"], [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                        for r in raw
                    ]
                queries.append(QueryResult(expr, legend, series))
            except PrometheusError as err:
                queries.append(QueryResult(expr, legend, [], str(err)))
        results.append(PanelResult(panel.get("title", ""), panel["type"], panel["gridPos"], queries))
    return results


def render(panels: list[PanelResult], out: Path, title: str, start: float) -> Path:
    """Draw the panels on the dashboard's grid (24 columns; a grid row is 30 px in Grafana) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(p.grid["y"] + p.grid["h"] for p in panels)
    unit_w, unit_h = 0.75, 0.36  # inches per grid column / grid row
    fig = plt.figure(figsize=(24 * unit_w, rows * unit_h + 0.6), facecolor="#181b1f")
    height = rows * unit_h + 0.6
    fig.text(0.01, 1 - 0.3 / height, title, color="white", fontsize=14, va="center")
    for panel in panels:
        x, y, w, h = (panel.grid[k] for k in ("x", "y", "w", "h"))
        left, width = x / 24 + 0.004, w / 24 - 0.008
        top = 1 - (0.6 + y * unit_h) / height
        if panel.type == "row":
            fig.text(left, top - 0.5 * unit_h / height, panel.title, color="#ccccdc", fontsize=12, weight="bold")
            continue
        bottom = 1 - (0.6 + (y + h) * unit_h) / height
        ax = fig.add_axes((left + 0.025, bottom + 0.035, width - 0.03, top - bottom - 0.07))
        _draw(ax, panel, start)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    plt.close(fig)
    return out


def _draw(ax: Any, panel: PanelResult, start: float) -> None:
    ax.set_facecolor("#111217")
    ax.tick_params(colors="#9fa7b3", labelsize=7)
    for spine in ax.spines.values():
        spine.set_color("#2c3235")
    ax.set_title(panel.title, color="#ccccdc", fontsize=9, loc="left")
    named = [(q.name(s), s) for q in panel.queries for s in q.series]
    errors = [q.error for q in panel.queries if q.error]
    if errors or not named:
        ax.text(0.5, 0.5, errors[0][:80] if errors else "No data", color="#f2495c", ha="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if panel.type == "table":
        ax.axis("off")
        for i, (name, s) in enumerate(named[:12]):
            ax.text(
                0.02,
                0.92 - i * 0.08,
                f"{name}    {s.values[-1]:g}",
                color="#ccccdc",
                fontsize=8,
                transform=ax.transAxes,
            )
        return
    if panel.type in _INSTANT_PANELS:
        names = [n for n, _ in named]
        ax.barh(names, [s.values[-1] for _, s in named], color="#73bf69")
        ax.invert_yaxis()
        ax.set_xlabel("seconds", color="#9fa7b3", fontsize=7)
        return
    for name, s in named:
        ax.plot([t - start for t in s.times], s.values, linewidth=1.2, label=name)
    ax.set_xlabel("seconds since start", color="#9fa7b3", fontsize=7)
    ax.legend(fontsize=6, loc="upper left", facecolor="#181b1f", labelcolor="#ccccdc", framealpha=0.6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", required=True, help="Prometheus URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10, help="the range: the last N minutes")
    parser.add_argument("--namespace", default=".*", help="value of the $namespace variable (a regex)")
    parser.add_argument("--job", default=".*", help="value of the $job variable (a regex)")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    prom = PrometheusClient(args.prometheus)
    end = time.time()
    start = end - args.minutes * 60
    panels = evaluate(prom, start, end, namespace=args.namespace, job=args.job)
    for problem in (p for panel in panels for p in panel.problems):
        print(f"dashboard: {problem}", file=sys.stderr)
    stamp = datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%d %H:%M UTC")
    render(panels, args.out, f"Megatron operator: {args.job} ({stamp})", start)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
