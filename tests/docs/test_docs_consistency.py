"""The hand-written documentation stays true to the code it describes: every relative link in the
repository's Markdown resolves (files, and anchors into the generated docs/api.md); no file holds a
merge conflict's markers; no file refers
to a document outside the repository; docs/operations.md names every exported metric of the
operator and the agent, every alert of the chart's PrometheusRule, every failure reason, and every
condition and event reason of status.py; docs/configuration.md names every operator setting and
every agent and worker environment variable, and the operator settings' defaults as the code has them."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from megatron_contract import wire
from megatron_operator import metrics as operator_metrics
from megatron_operator import settings as operator_settings
from megatron_operator.failures import FailureReason
from megatron_operator.status import Reason
from megatron_trainer.agent import settings as agent_settings
from megatron_trainer.agent.metrics import AgentMetrics
from megatron_trainer.worker import settings as worker_settings

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MARKDOWN = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "benchmarks" / "README.md",
    REPO / "operator" / "README.md",
    *sorted(DOCS.glob("*.md")),
]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _operations() -> str:
    return (DOCS / "operations.md").read_text()


def test_relative_links_resolve() -> None:
    broken = []
    for doc in MARKDOWN:
        prose = re.sub(r"`[^`\n]*`", "", doc.read_text())  # code spans hold no links (regexes may look like one)
        for target in _LINK.findall(prose):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
            elif anchor and file.suffix == ".md" and f'id="{anchor}"' not in file.read_text():
                heading_ids = {
                    re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                }
                if anchor not in heading_ids:
                    broken.append(f"{doc.relative_to(REPO)}: {target} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


_SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".localcluster"}


def _text_files() -> list[tuple[Path, str]]:
    files = []
    for path in REPO.rglob("*"):
        if not path.is_file() or _SKIP_DIRS & set(path.relative_to(REPO).parts) or path == Path(__file__):
            continue
        try:
            files.append((path, path.read_text()))
        except (UnicodeDecodeError, OSError):
            continue
    return files


def test_no_merge_conflict_left_in_any_file() -> None:
    marker = re.compile(r"^(<{7} |>{7} |={7}$)")
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path, text in _text_files()
        for n, line in enumerate(text.splitlines(), 1)
        if marker.match(line)
    ]
    assert not found, "merge conflict markers:\n" + "\n".join(found)


def test_nothing_refers_to_documents_outside_the_repository() -> None:
    outside = re.compile(r"\.\./shared/|shared/(DESIGN|FACTS|STYLE)\.md")
    skip_dirs = _SKIP_DIRS
    found = []
    for path in REPO.rglob("*"):
        if not path.is_file() or skip_dirs & set(path.relative_to(REPO).parts) or path == Path(__file__):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [
            f"{path.relative_to(REPO)}:{n}" for n, line in enumerate(text.splitlines(), 1) if outside.search(line)
        ]
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def _exposed_names(owner: object) -> set[str]:
    """Names of the series the metric objects held by ``owner`` expose (counters end in ``_total``)."""
    names = set()
    for metric in vars(owner).values():
        if isinstance(metric, MetricWrapperBase):
            for family in metric.describe():
                names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_operations_names_every_metric() -> None:
    names = _exposed_names(operator_metrics) | _exposed_names(AgentMetrics())
    assert {n.split("_")[1] for n in names} == {"operator", "agent"}
    missing = sorted(n for n in names if f"`{n}" not in _operations())
    assert not missing, f"docs/operations.md does not name these metrics: {missing}"


def test_operations_names_every_alert_and_reason() -> None:
    rule = (REPO / "charts" / "megatron-operator" / "templates" / "prometheusrule.yaml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rule)
    assert alerts
    reasons = [r.value for r in FailureReason] + [v for k, v in vars(Reason).items() if k.isupper()]
    text = _operations()
    missing = [f"alert {a}" for a in alerts if f"### `{a}`" not in text]
    missing += [f"reason {r}" for r in reasons if f"`{r}`" not in text]
    assert not missing, f"docs/operations.md does not cover: {missing}"


def test_configuration_names_every_setting() -> None:
    text = (DOCS / "configuration.md").read_text()
    names = [v for k, v in vars(operator_settings).items() if k.startswith("ENV_") and k != "ENV_PREFIX"]
    names += [v for k, v in vars(wire).items() if k.startswith("ENV_")]
    names += [v for k, v in vars(agent_settings).items() if k.startswith("ENV_")]
    names += [v for k, v in vars(worker_settings).items() if k.startswith("ENV_")]
    names += list(worker_settings.NCCL_DEFAULTS)
    assert len(names) > 30
    missing = sorted({n for n in names if f"`{n}`" not in text and n != "KUBECONFIG"})
    assert not missing, f"docs/configuration.md does not name: {missing}"


def test_configuration_gives_the_operator_defaults() -> None:
    rows = {}
    for line in (DOCS / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`MEGATRON_OPERATOR_"):
            rows.setdefault(cells[0].strip("`"), cells[1])  # the Operator section comes first
    wrong = []
    for name, field in operator_settings.OperatorSettings.model_fields.items():
        env = operator_settings.ENV_PREFIX + name.upper()
        default = field.default
        if default is None or default == "":
            expected = {"unset", "unset (off)", "empty", "hostname-pid"}
        elif isinstance(default, bool):
            expected = {f"`{str(default).lower()}`"}
        elif isinstance(default, float) and default.is_integer():
            expected = {f"`{int(default)}`"}
        else:
            expected = {f"`{default}`"}
        if rows.get(env) not in expected:
            wrong.append(f"{env}: documented {rows.get(env)!r}, default {default!r}")
    assert not wrong, "docs/configuration.md gives wrong operator defaults:\n" + "\n".join(wrong)
