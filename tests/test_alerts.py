"""The alert rules, their unit tests and the dashboard select only series and label values the
gateway emits: each metric's declared values (gateway.support.metrics), the ones README lists.
(promtool runs the rules' tests, and a real Prometheus the expressions: tests/test_deploy.py.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from gateway.support import metrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "pd-gateway.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "pd-gateway.rules.test.yml"
SELECTOR = re.compile(r"\b(pd_gateway_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
SUFFIXES = ("_total", "_bucket", "_count", "_sum")
SCRAPE_LABELS = {"job", "instance", "le"}  # Prometheus' own, and a histogram's bucket


def _dashboard_queries() -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "pd_gateway_dashboard", DEPLOY / "grafana" / "dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.queries(module.dashboard())


def _rule_expressions() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _test_series() -> list[str]:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return [s["series"] for t in tests for s in t.get("input_series", [])]


def _declared(name: str):
    for metric in metrics.DECLARED:
        if name in (metric._name + suffix for suffix in ("", *SUFFIXES)):
            return metric
    return None


def _wrong_values(text: str) -> list[str]:
    """What a PromQL text selects that the gateway never emits: unknown metrics, labels, or
    label values (an exact value outside a closed set, or a regex no declared value matches)."""
    wrong = []
    for name, matchers in SELECTOR.findall(text):
        metric = _declared(name)
        if metric is None:
            wrong.append(f"{name}: not a metric of the gateway")
            continue
        for label, op, value in MATCHER.findall(matchers):
            if label in SCRAPE_LABELS:
                continue
            if label not in metric.values:
                wrong.append(f"{name}: no label {label}")
                continue
            allowed = metric.values[label]
            if isinstance(allowed, str):  # an open set: engines' names, models, statuses
                if label == "status" and op == "=" and not re.fullmatch(r"[1-5]\d\d", value):
                    wrong.append(f"{name}: status {value!r}")
                continue
            # Each alternative of a regex must match a value the gateway emits.
            for pattern in value.split("|") if op in ("=~", "!~") else [re.escape(value)]:
                if not any(re.fullmatch(pattern, v) for v in allowed):
                    wrong.append(f"{name}: {label}{op}{value!r} matches none of {allowed}")
    return wrong


def test_the_rules_and_the_dashboard_select_only_what_the_gateway_emits():
    texts = _rule_expressions() + _dashboard_queries()
    assert sum(len(SELECTOR.findall(t)) for t in texts) >= 20
    assert [w for t in texts for w in _wrong_values(t)] == []


def test_the_rules_unit_tests_feed_only_series_the_gateway_emits():
    series = _test_series()
    assert len(series) >= 15
    assert [w for s in series for w in _wrong_values(s)] == []
    # Every label of each fed series, too (a series with a label the metric lacks would match
    # no real scrape).
    for text in series:
        name, matchers = SELECTOR.search(text).groups()
        labels = {label for label, _, _ in MATCHER.findall(matchers)} - SCRAPE_LABELS
        assert labels == set(_declared(name).values), text


def test_the_check_finds_what_a_wrong_rule_would_select():
    assert _wrong_values('pd_gateway_errors_total{stage="decode"}') == [
        "pd_gateway_errors_total: stage='decode' matches none of ('request', 'stream')"
    ]
    assert _wrong_values('pd_gateway_requests_total{cache=~"hit|read"}') == [
        "pd_gateway_requests_total: cache=~'hit|read' matches none of ('hit', 'partial', 'miss')"
    ]
    assert _wrong_values('pd_gateway_admissions_total{result=~"rejected_.*"}') == []
    assert _wrong_values('pd_gateway_requests_total{cachee="hit"}') == [
        "pd_gateway_requests_total: no label cachee"
    ]
    assert _wrong_values('pd_gateway_hits_total{job="x"}') == [
        "pd_gateway_hits_total: not a metric of the gateway"
    ]


def test_the_dashboard_needs_no_recording_rule():
    assert [q for q in _dashboard_queries() if "pd_gateway:" in q] == []
