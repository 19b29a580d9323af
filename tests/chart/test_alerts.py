"""The alert rules pass promtool's checks and its unit tests (one test group per alert)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.chart import chart

RULES = chart.CHART / "alerts" / "weightcache.rules.yaml"
TESTS = chart.CHART / "alerts" / "tests" / "weightcache.rules.test.yaml"
ALERTS = {
    "WeightCacheDegraded",
    "WeightCacheRankDown",
    "WeightCacheFallbackRateHigh",
    "WeightCacheAlignmentMisses",
    "WeightCacheWebhookErrors",
    "WeightCacheWebhookCertificateExpiring",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip("promtool not installed (make prometheus installs Debian's prometheus)")
    return found


def test_check_rules(promtool):
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_unit_tests_pass(promtool):
    out = subprocess.run(
        [promtool, "test", "rules", TESTS.name], capture_output=True, text=True, cwd=TESTS.parent
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_unit_test_that_fires_it():
    rules = yaml.safe_load(RULES.read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert names == ALERTS
    tests = yaml.safe_load(TESTS.read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if not case.get("exp_alerts")
    }
    assert fired == ALERTS, "each alert needs a case where it fires"
    assert quiet == ALERTS, "each alert needs a case where it stays quiet"


def test_every_alert_says_what_to_do():
    rules = yaml.safe_load(RULES.read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"]):
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 40


RUNBOOKS = chart.ROOT / "docs" / "runbooks"


def test_every_alert_links_its_runbook_page():
    home = yaml.safe_load((chart.CHART / "Chart.yaml").read_text())["home"].rstrip("/")
    rules = yaml.safe_load(RULES.read_text())
    for rule in (r for g in rules["groups"] for r in g["rules"] if "alert" in r):
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"{home}/docs/runbooks/{name}.md", name
        page = (RUNBOOKS / f"{name}.md").read_text()
        assert page.startswith(f"# {name}\n")
        for section in ("**Meaning.**", "**Impact.**", "**Diagnosis.**", "**Mitigation.**"):
            assert section in page, (name, section)
    assert {p.stem for p in RUNBOOKS.glob("*.md")} == ALERTS


def test_cache_alerts_name_the_cache_and_where():
    """Alerts on cache series keep namespace and cache (and node where the series has it) in
    their labels, so the notification says which cache on which node."""
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    for name, where in {"WeightCacheDegraded": ("namespace", "cache"),
                        "WeightCacheRankDown": ("namespace", "cache", "node"),
                        "WeightCacheFallbackRateHigh": ("namespace", "cache", "node")}.items():
        expr = rules[name]["expr"]
        for label in where:
            assert label in expr.split("by (", 1)[1].split(")", 1)[0], (name, label)
            assert f"$labels.{label}" in rules[name]["annotations"]["summary"], (name, label)
