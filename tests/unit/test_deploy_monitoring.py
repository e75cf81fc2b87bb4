"""The alert rules and the dashboard: valid, and only about metrics the relay exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_NAME = re.compile(r"\b(outbox_relay_[a-z_]+)\b")


def exported_names() -> set[str]:
    """Every sample name a relay's /metrics can carry, suffixes included."""
    metrics = Metrics(CollectorRegistry())
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
        if family.type == "histogram":
            names.update(f"{family.name}_{s}" for s in ("bucket", "count", "sum"))
        if family.type == "counter":
            names.add(f"{family.name}_total")
    return names


@pytest.mark.parametrize("path", ["prometheus/alerts.yml", "grafana/outbox-relay.json"])
def test_every_metric_used_is_exported(path):
    used = set(METRIC_NAME.findall((DEPLOY / path).read_text()))
    assert used, "no metrics found"
    assert used <= exported_names(), sorted(used - exported_names())


def test_dashboard_is_valid_json_with_a_query_per_panel():
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(t["expr"] for t in panel["targets"])


def test_the_issue_metrics_exist():
    names = exported_names()
    for name in (
        "outbox_relay_published_total",
        "outbox_relay_publish_failures_total",
        "outbox_relay_unpublished_rows",
        "outbox_relay_oldest_unpublished_age_seconds",
        "outbox_relay_dead_rows",
        "outbox_relay_publish_latency_seconds_bucket",
        "outbox_relay_batch_size_bucket",
        "outbox_relay_wakeups_total",
        "outbox_relay_retention_deleted_total",
        "outbox_relay_listen_connected",
        "outbox_relay_nats_connected",
        "outbox_relay_up",
        "outbox_relay_build_info",
    ):
        assert name in names, name
