"""The Grafana dashboard and the Prometheus scrape config in deploy/ only name metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from workers.metrics import EngineMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}


def exported_names() -> set[str]:
    """Every sample name an engine replica's exposition can carry (what the ingress's /metrics merges)."""
    names = set()
    for family in EngineMetrics("r0").registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def dashboard_queries() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "kvrelay.json").read_text())
    queries = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return queries


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_names()
    queries = dashboard_queries()
    assert len(queries) >= 16
    for query in queries:
        named = re.findall(r"kvrelay:[A-Za-z0-9_:]+", query)
        assert named, f"no kvrelay metric in {query!r}"
        unknown = [n for n in named if n not in exported]
        assert not unknown, f"{query!r} names metrics the server does not export: {unknown}"


def test_the_dashboard_covers_the_operator_questions():
    """Queue depth, running batch, KV usage, preemptions, token rates and TTFT/ITL/e2e percentiles, per replica."""
    text = " ".join(dashboard_queries())
    for metric in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "num_preemptions_total",
                   "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"kvrelay:{metric}" in text
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}," in text
    assert text.count('replica=~"$replica"') >= 16


def test_prometheus_scrapes_the_ingress_metrics_path():
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = doc["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
