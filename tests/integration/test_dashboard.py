"""The dashboard (deploy/grafana/outbox-relay.json) against real metrics: a real
Prometheus scrapes two real relays through a short run with a broker outage, and
every panel's own PromQL runs against it (`outbox-relay bench --dashboard --quick`)."""

from __future__ import annotations

import asyncio

import pytest

from relay_tools.bench import dashboard

pytestmark = pytest.mark.integration


def values(points: list[list[float | None]]) -> list[float]:
    return [value for _, value in points if value is not None]


def test_the_dashboards_panels_show_two_relays_through_a_broker_outage():
    plan = dashboard.DashboardPlan.quick()
    with asyncio.Runner() as runner:
        run = runner.run(dashboard._main(plan))  # every query is accepted, or it raises
    panels = {p["title"]: {s["label"]: s["points"] for s in p["series"]} for p in run["panels"]}
    published = panels["Published events/s by type"]
    for suffix, _ in plan.rates:
        (points,) = (points for label, points in published.items() if label.endswith(suffix))
        assert max(values(points)) > 0, suffix
    # The row no stream captures: failures by reason, and the gauge of such subjects.
    assert max(values(panels["Publish failures/s by reason"]["no_stream"])) > 0
    no_stream = "subjects no stream captures"
    assert values(panels["Held subjects, skipped rows, subjects without a stream"][no_stream])[-1]
    # The row over max_payload went dead, and holds its subject.
    assert max(values(panels["Backlog (unpublished rows)"]["dead"])) == 1
    (dead,) = panels[
        "Rows moved to the cap, by type and reason (since each relay started)"
    ].values()
    assert max(values(dead)) == 1
    # Each replica showed the broker gone, and back.
    connections = panels["Connections per replica"]
    for relay in ("relay-1", "relay-2"):
        nats = values(connections[f"NATS {relay}"])
        assert min(nats) == 0, relay
        assert nats[-1] == 1, relay
        assert set(values(connections[f"up {relay}"])) == {1}, relay
