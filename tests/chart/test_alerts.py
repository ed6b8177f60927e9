"""The chart's PrometheusRule: `promtool check rules` accepts it and `promtool test rules` runs the
alert unit tests in alerts_test.yaml against it (promtool is built from Prometheus' Go module and
cached like the control plane). A mutated rule must make those tests fail, so they are not vacuous."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from localcluster import build
from localcluster.prometheus import render_chart, rule_groups

ALERT_TESTS = Path(__file__).with_name("alerts_test.yaml")


@pytest.fixture(scope="module")
def promtool() -> Path:
    return build.build(build.PROMTOOL)


def _promtool_test(promtool: Path, rules: dict, workdir: Path) -> subprocess.CompletedProcess[str]:
    (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(ALERT_TESTS, workdir / ALERT_TESTS.name)
    return subprocess.run(
        [str(promtool), "test", "rules", ALERT_TESTS.name], cwd=workdir, capture_output=True, text=True
    )


def test_rules_pass_promtool_check(promtool: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups(render_chart()), sort_keys=False))
    proc = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 rules found" in proc.stdout, proc.stdout


def test_alert_unit_tests_pass(promtool: Path, tmp_path: Path) -> None:
    proc = _promtool_test(promtool, rule_groups(render_chart()), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


def test_alert_unit_tests_catch_rules_keyed_on_target_labels(promtool: Path, tmp_path: Path) -> None:
    """The rules as they were before the label fix (by namespace, job): the tests must fail."""
    rules = rule_groups(render_chart())
    for rule in rules["groups"][0]["rules"]:
        rule["expr"] = rule["expr"].replace("megatronjob_namespace, megatronjob", "namespace, job")
    proc = _promtool_test(promtool, rules, tmp_path)
    assert proc.returncode != 0, "alert tests passed against rules keyed on the scrape target's labels"
