"""The pd-gateway Grafana dashboard, written as code: `python deploy/grafana/dashboard.py` writes
pd-gateway.json beside it. tests/test_deploy.py checks the JSON is what this writes, and that
every metric its queries name is one the gateway exports, so a renamed metric fails the suite.
Its panels query the gateway's metrics themselves, not deploy/prometheus' recording rules: the
dashboard works on a Prometheus that does not load them.

Hand-written rather than grafana-foundation-sdk: the dashboard is a few dicts, and the SDK's
builders would be a dependency of the suite for them.
"""

from __future__ import annotations

import json
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job=~"$job"'


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    kind: str = "timeseries",
    description: str = "",
) -> dict:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "expr": expr,
                "legendFormat": legend,
                "datasource": DATASOURCE,
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


RESPONSES, ERRORS = "pd_gateway_responses_total", "pd_gateway_errors_total"
KV_READS, REQUESTS = "pd_gateway_kv_reads_total", "pd_gateway_requests_total"
FAILED, IN_STREAM, THROTTLED = 'status=~"5.."', 'stage="stream"', 'status="429"'
READ, REPORTED, SENT = 'result="read"', 'result!="unreported"', 'cache=~"hit|partial"'


def rate(metric: str, selector: str = "") -> str:
    """A metric's per-second rate over 5 minutes, on the jobs the dashboard shows."""
    return f"rate({metric}{{{JOB}{',' + selector if selector else ''}}}[5m])"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket')}))"


ROWS = [
    (
        "Traffic",
        [
            panel(
                "Requests per second",
                [(f"sum by (model, status) ({rate(RESPONSES)})", "{{model}} {{status}}")],
                "reqps",
                description="Completion requests answered, by model and status.",
            ),
            panel(
                "Errors per second",
                [(f"sum by (stage, status) ({rate(ERRORS)})", "{{stage}} {{status}}")],
                "reqps",
                description="stage request: an error reply; stream: an error event after the first "
                "byte.",
            ),
            panel(
                "Share of answers that are errors, and 429s",
                [
                    (
                        f"sum({rate(RESPONSES, FAILED)} or {rate(ERRORS, IN_STREAM)} or "
                        f"{rate(RESPONSES)} * 0) / sum({rate(RESPONSES)})",
                        "5xx and error events",
                    ),
                    (
                        f"sum({rate(RESPONSES, THROTTLED)} or {rate(RESPONSES)} * 0) / "
                        f"sum({rate(RESPONSES)})",
                        "429",
                    ),
                ],
                "percentunit",
                description="As the PDGatewayErrors alert counts: 5xx replies and streams cut "
                "by an error event, over every answer.",
            ),
        ],
    ),
    (
        "Latency",
        [
            panel(
                "Time to first byte",
                [
                    (quantile(0.5, "pd_gateway_time_to_first_byte_seconds"), "p50"),
                    (quantile(0.99, "pd_gateway_time_to_first_byte_seconds"), "p99"),
                ],
                "s",
            ),
            panel(
                "Inter-token latency (chunks sent to the client)",
                [
                    (quantile(0.5, "pd_gateway_inter_token_latency_seconds"), "p50"),
                    (quantile(0.99, "pd_gateway_inter_token_latency_seconds"), "p99"),
                ],
                "s",
            ),
            panel(
                "End to end (completed turns)",
                [
                    (quantile(0.5, "pd_gateway_e2e_request_latency_seconds"), "p50"),
                    (quantile(0.99, "pd_gateway_e2e_request_latency_seconds"), "p99"),
                ],
                "s",
            ),
            panel(
                "Prefill call to P", [(quantile(0.99, "pd_gateway_prefill_seconds"), "p99")], "s"
            ),
        ],
    ),
    (
        "KV reuse: what P read of D's blocks, and why not",
        [
            panel(
                "Turns whose P read D's blocks, and turns sent them",
                [
                    (
                        f"sum({rate(KV_READS, READ)} or {rate(KV_READS, REPORTED)} * 0) / "
                        f"sum({rate(KV_READS, REPORTED)})",
                        "read, of the turns sent D's params",
                    ),
                    (
                        f"sum({rate(REQUESTS, SENT)} or {rate(REQUESTS)} * 0) / "
                        f"sum({rate(REQUESTS)})",
                        "served with D's blocks (sent to P, or decode-only), of all turns",
                    ),
                ],
                "percentunit",
                description="Read: what P reported (pd_gateway_kv_reads_total). A turn sent D's "
                "params is recomputed when the part to read is under vLLM's "
                "kv_recompute_threshold (64 tokens).",
            ),
            panel(
                "Prompt tokens P did not compute, by the turn's outcome",
                [(f"sum by (kv) ({rate('pd_gateway_prefill_cached_tokens_total')})", "{{kv}}")],
                "short",
            ),
            panel(
                "Turn paths and why",
                [
                    (
                        f"sum by (path, reason) (rate(pd_gateway_turn_paths_total{{{JOB}}}[5m]))",
                        "{{path}} {{reason}}",
                    )
                ],
                "ops",
            ),
            panel(
                "Reuse checks",
                [
                    (
                        f"sum by (result) (rate(pd_gateway_reuse_checks_total{{{JOB}}}[5m]))",
                        "{{result}}",
                    )
                ],
                "ops",
            ),
            panel(
                "What P read of what D held",
                [(f"sum by (result) (rate(pd_gateway_kv_reads_total{{{JOB}}}[5m]))", "{{result}}")],
                "ops",
            ),
            panel(
                "Conversation store events",
                [(f"sum by (event) (rate(pd_gateway_entries_total{{{JOB}}}[5m]))", "{{event}}")],
                "ops",
            ),
        ],
    ),
    (
        "Engines",
        [
            panel(
                "Engines up (0: down or breaker open)",
                [(f"min by (role, engine) (pd_gateway_engine_up{{{JOB}}})", "{{role}} {{engine}}")],
                "short",
            ),
            panel(
                "In flight per engine (every worker)",
                [
                    (
                        f"sum by (role, engine) (pd_gateway_engine_inflight{{{JOB}}})",
                        "{{role}} {{engine}}",
                    )
                ],
                "short",
            ),
            panel(
                "Retries on another engine",
                [(f"sum by (role) (rate(pd_gateway_retries_total{{{JOB}}}[5m]))", "{{role}}")],
                "ops",
            ),
            panel(
                "Engines' /metrics reads",
                [
                    (
                        f"sum by (role, result) "
                        f"(rate(pd_gateway_engine_metrics_reads_total{{{JOB}}}[5m]))",
                        "{{role}} {{result}}",
                    )
                ],
                "ops",
            ),
        ],
    ),
    (
        "Admission and tenants",
        [
            panel(
                "Admission",
                [
                    (
                        f"sum by (result) (rate(pd_gateway_admissions_total{{{JOB}}}[5m]))",
                        "{{result}}",
                    )
                ],
                "ops",
            ),
            panel(
                "Refused for a key's rate",
                [
                    (
                        f"sum by (limit) (rate(pd_gateway_rate_limited_total{{{JOB}}}[5m]))",
                        "{{limit}}",
                    )
                ],
                "ops",
            ),
        ],
    ),
    (
        "Store and D memory",
        [
            panel(
                "Store errors",
                [
                    (
                        f"sum by (operation) (rate(pd_gateway_store_errors_total{{{JOB}}}[5m]))",
                        "{{operation}}",
                    )
                ],
                "ops",
            ),
            panel(
                "Blocks each D keeps for idle conversations, and its budget",
                [
                    (f"sum by (decode) (pd_gateway_pinned_blocks{{{JOB}}})", "{{decode}}"),
                    (
                        f"sum by (decode) (pd_gateway_pinned_blocks_budget{{{JOB}}})",
                        "{{decode}} budget",
                    ),
                ],
                "short",
            ),
            panel(
                "Releases of blocks no turn will read",
                [
                    (
                        f"sum by (reason, result) (rate(pd_gateway_releases_total{{{JOB}}}[5m]))",
                        "{{reason}} {{result}}",
                    )
                ],
                "ops",
            ),
        ],
    ),
    (
        "Workers",
        [
            panel(
                "Forwarded to the owner worker",
                [
                    (
                        f"sum by (result) (rate(pd_gateway_forwarded_total{{{JOB}}}[5m]))",
                        "{{result}}",
                    )
                ],
                "ops",
            ),
            panel(
                "Clients gone before the end",
                [(f"sum(rate(pd_gateway_client_disconnects_total{{{JOB}}}[5m]))", "disconnects")],
                "ops",
            ),
        ],
    ),
]


def dashboard() -> dict:
    panels, y = [], 0
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "id": len(panels) + 1,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        for i, p in enumerate(row):
            width = 24 // min(3, len(row))
            panels.append(
                {
                    **p,
                    "id": len(panels) + 1,
                    "gridPos": {"h": 8, "w": width, "x": (i % 3) * width, "y": y + (i // 3) * 8},
                }
            )
        y += 8 * ((len(row) + 2) // 3)
    return {
        "uid": "pd-gateway",
        "title": "pd-gateway",
        "tags": ["vllm", "pd-gateway"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "job",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "label": "job",
                    "query": {
                        "query": "label_values(pd_gateway_admissions_total, job)",
                        "refId": "job",
                    },
                    "definition": "label_values(pd_gateway_admissions_total, job)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".+",
                    "refresh": 2,
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def queries(board: dict) -> list[str]:
    """Every PromQL expression the dashboard runs: its panels', and the series its variables
    take their values from (Grafana's `label_values(series, label)`)."""
    out = [p_target["expr"] for p in board["panels"] for p_target in p.get("targets", [])]
    out += [
        v["definition"].removeprefix("label_values(").rsplit(",", 1)[0]
        for v in board["templating"]["list"]
        if "definition" in v
    ]
    return out


PATH = Path(__file__).with_name("pd-gateway.json")


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    PATH.write_text(render())
    print(f"wrote {PATH}")
