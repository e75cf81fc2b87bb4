"""The alert rules and the dashboard: valid, and only about metrics the relay exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.metrics import Metrics
from relay_tools.bench import dashboard

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


def test_the_dashboards_panels_are_read_with_their_queries_legends_and_grid():
    board = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text())
    read = dashboard.panels(board)
    assert [p.title for p in read] == [p["title"] for p in board["panels"]]
    assert all(p.targets and p.w in (12, 24) and p.unit in ("ops", "s", "short") for p in read)


def test_rate_interval_is_grafanas():
    # The larger of four scrapes and a step plus a scrape.
    assert dashboard.rate_interval(step=2, scrape=1) == "4s"
    assert dashboard.rate_interval(step=15, scrape=1) == "16s"
    assert dashboard.expand("rate(x[$__rate_interval])", "4s") == "rate(x[4s])"


def test_a_series_is_named_by_its_legend_and_keeps_no_rate_as_none():
    answer = {"data": {"result": [
        {"metric": {"reason": "no_stream", "instance": "relay-1"},
         "values": [[100.0, "NaN"], [102.0, "0.5"]]},
    ]}}  # fmt: skip
    assert dashboard.series(answer, "{{reason}} on {{ instance }}", start=100.0) == [
        {"label": "no_stream on relay-1", "points": [[0.0, None], [2.0, 0.5]]}
    ]
    assert dashboard.legend("", {"__name__": "m", "b": "2", "a": "1"}) == "a=1, b=2"


def test_the_dashboards_figures_are_written_a_series_to_a_line_and_read_back_whole():
    figures = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.json"
    document = json.loads(figures.read_text())
    text = dashboard._lines(document)
    assert json.loads(text) == document
    series = sum(len(panel["series"]) for panel in document["dashboard"]["panels"])
    assert len(text.splitlines()) == 3 + len(document["dashboard"]["panels"]) * 2 + series
