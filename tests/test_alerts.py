"""Alerts as code (monitoring/alerts.yaml): `promtool check rules`, `promtool test rules` with every
alert shown firing on a synthetic failure and silent on a healthy series, only metric names the
code exports, and the PrometheusRule of deploy/components/monitoring carrying the same groups."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.helpers import REPO
from tests.metric_names import BUILTIN, exported, read_by

MONITORING = REPO / "monitoring"
RULES = MONITORING / "alerts.yaml"
RULE_TESTS = MONITORING / "alerts_test.yaml"


def alerts() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rules(promtool: str) -> None:
    proc = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    proc = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                          cwd=MONITORING)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_tested_firing_and_silent() -> None:
    """An alert added without a case that fires it and one that keeps it quiet fails here."""
    fired: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {str(a["alert"]) for a in alerts()}
    assert names - fired == set(), "alerts never shown firing"
    assert names - silent == set(), "alerts never shown silent"
    assert len(names) == len(alerts()), "two alerts share a name"


def test_the_rules_read_only_metrics_the_code_exports() -> None:
    names = exported() | BUILTIN
    for alert in alerts():
        missing = read_by(str(alert["expr"])) - names
        assert missing == set(), f"{alert['alert']} reads {sorted(missing)}, which nothing exports"


def test_every_alert_says_what_and_how_bad() -> None:
    for alert in alerts():
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}  # type: ignore[index]
        assert {"summary", "description"} <= set(alert["annotations"])  # type: ignore[arg-type]


def test_the_prometheus_rule_carries_the_same_groups() -> None:
    rule = yaml.safe_load((REPO / "deploy" / "components" / "monitoring" / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_the_names_a_query_reads() -> None:
    """The parser the checks rely on (a name it missed would go unchecked)."""
    assert read_by('sum by (cache) (rate(modelcache_a_total{job=~"x.*"}[5m])) / on(instance) group_left() '
                   "modelcache_b > 0.1 and time() - modelcache_c > 600") == \
        {"modelcache_a_total", "modelcache_b", "modelcache_c"}
    assert read_by('histogram_quantile(0.9, sum by (le) (rate(x_bucket{node="$node"}[$__rate_interval])))') == \
        {"x_bucket"}


def test_rule_files_exist() -> None:
    assert Path(RULES).exists() and Path(RULE_TESTS).exists()
