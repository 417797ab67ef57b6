"""The metrics say what happened: every label value declared (README lists them), the new
latency histograms as vLLM's, and every answered request counted by its status."""

from __future__ import annotations

import uuid

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from devtools.workload import MODEL
from gateway.support import metrics
from tests.helpers.servers import metric

CHAT = "/v1/chat/completions"


def samples(registry: CollectorRegistry) -> dict:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_observe_many_writes_what_observe_writes():
    values = [0.0, 0.01, 0.012, 0.05, 0.3, 2.0, 79.0, 80.0, 120.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = metrics.Histogram(
        "gaps_seconds",
        "h",
        ["model"],
        values={"model": "any"},
        buckets=metrics.ITL_BUCKETS,
        registry=one,
    )
    by_many = metrics.Histogram(
        "gaps_seconds",
        "h",
        ["model"],
        values={"model": "any"},
        buckets=metrics.ITL_BUCKETS,
        registry=many,
    )
    for value in values:
        by_one.labels("m").observe(value)
    counts = metrics.bucket_counts(metrics.ITL_BUCKETS)
    for value in values:
        metrics.count_into(counts, metrics.ITL_BUCKETS, value)
    by_many.labels("m").observe_many(counts, sum(values))
    assert samples(one) == samples(many)
    assert samples(one)[("gaps_seconds_bucket", (("le", "0.01"), ("model", "m")))] == 2.0


def test_a_label_value_not_declared_is_refused_where_the_suite_runs(monkeypatch):
    counter = metrics.Counter(
        "things", "t", ["kind"], values={"kind": ("a", "b")}, registry=CollectorRegistry()
    )
    counter.labels("a").inc()
    monkeypatch.setattr(metrics, "_STRICT", True)
    with pytest.raises(ValueError, match="kind='c' is not declared"):
        counter.labels("c")
    monkeypatch.setattr(metrics, "_STRICT", False)
    counter.labels("c").inc()  # in production: logged, counted
    with pytest.raises(AssertionError, match="declare the values"):
        metrics.Counter("other", "o", ["kind"], registry=CollectorRegistry())


def test_every_metric_declares_its_labels_values_and_the_suite_is_strict():
    import os

    assert os.environ.get(metrics.STRICT_ENV) == "1" and metrics._STRICT
    for declared in metrics.DECLARED:
        assert list(declared.values) == list(declared._labelnames), declared._name
    assert {m._name for m in metrics.DECLARED} >= {
        "pd_gateway_responses",
        "pd_gateway_e2e_request_latency_seconds",
        "pd_gateway_inter_token_latency_seconds",
        "pd_gateway_prefill_cached_tokens",
    }


@pytest.mark.processes
def test_every_answer_is_counted_by_status_and_model_and_the_turns_timed(
    fresh_engines, gateway_factory
):
    p, d = fresh_engines
    gateway = gateway_factory([p.url], [d.url])
    url = gateway.url + CHAT

    def count(name: str, **labels) -> float:
        return metric(gateway, name, **labels)

    before = {
        status: count("pd_gateway_responses_total", status=status)
        for status in ("200", "400", "404")
    }
    timed = {
        name: count(name + "_count", model=MODEL)
        for name in (
            "pd_gateway_e2e_request_latency_seconds",
            "pd_gateway_inter_token_latency_seconds",
            "pd_gateway_time_to_first_byte_seconds",
        )
    }
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "stream": True,
        "conversation_id": uuid.uuid4().hex,
        "messages": [{"role": "user", "content": "count me"}],
    }
    for _ in range(2):
        with requests.post(url, json=body, stream=True, timeout=30) as reply:
            assert reply.status_code == 200 and b"[DONE]" in reply.content
    assert requests.post(url, data=b"{", timeout=30).status_code == 400
    # A model no engine serves: the engine's 404, relayed, labelled unknown (not its text).
    other = {**body, "model": "no-such-model-" + uuid.uuid4().hex, "stream": False}
    assert requests.post(url, json=other, timeout=30).status_code == 404
    assert {
        status: count("pd_gateway_responses_total", status=status) - before[status]
        for status in before
    } == {"200": 2, "400": 1, "404": 1}
    assert count("pd_gateway_responses_total", status="200", model=MODEL) >= 2
    text = requests.get(gateway.url + "/metrics", timeout=5).text
    assert "no-such-model" not in text
    assert count("pd_gateway_responses_total", status="404", model="unknown") >= 1
    # Two completed streams: two ends and first bytes; 8 tokens each, 7 gaps at most.
    assert {name: count(name + "_count", model=MODEL) - timed[name] for name in timed} == {
        "pd_gateway_e2e_request_latency_seconds": 2,
        "pd_gateway_inter_token_latency_seconds": pytest.approx(14, abs=12),
        "pd_gateway_time_to_first_byte_seconds": 2,
    }
    buckets = [
        s.labels["le"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pd_gateway_inter_token_latency_seconds_bucket"
        and s.labels.get("model") == MODEL
    ]
    assert buckets[:3] == ["0.01", "0.025", "0.05"]  # vLLM's own buckets
