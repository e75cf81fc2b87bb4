"""Prometheus metrics. One registry per relay, so tests can run several in a process."""

from __future__ import annotations

import bisect
import importlib.resources
import math
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from relay import __version__

# The *_created series double every counter's lines and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call] # untyped upstream, takes no arguments


def _build(spec: Mapping[str, Any], registry: CollectorRegistry) -> Any:
    """One metric of relay/metrics.toml, registered."""
    name, help_text, labels = spec["name"], spec["help"], spec.get("labels", [])
    kind = spec["kind"]
    if kind == "batch_histogram":
        return BatchHistogram(name, help_text, LATENCY_BUCKETS, registry)
    if kind == "histogram":
        return Histogram(name, help_text, buckets=BATCH_BUCKETS, registry=registry)
    collector = {"counter": Counter, "gauge": Gauge, "info": Info}[kind]
    return collector(name, help_text, labels, registry=registry)


# Buckets that resolve single milliseconds near the bottom and minutes at the top.
LATENCY_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 200, 300, 400, 500, 1000, 2000)


class BatchHistogram(Collector):
    """A histogram fed a batch of values at a time.

    prometheus_client's ``Histogram.observe`` takes two locks and walks the buckets
    in Python for every value, a visible share of the relay's CPU while it drains
    (docs/performance.md). This one bins a batch with ``bisect`` and is read by the registry like
    any histogram. The relay feeds and scrapes it from one thread."""

    def __init__(
        self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [*sorted(buckets), math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self._counts, self._bounds
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # "le": value <= bound
            total += value
        self._sum += total

    def collect(self) -> Iterator[Metric]:
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )


class BoundedLabel:
    """Label values taken from table data (event types) are capped, so a producer bug
    that invents types cannot blow up the relay's memory or Prometheus's series."""

    OVERFLOW = "_other"

    def __init__(self, limit: int = 500) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self._limit:
            self._seen.add(value)
            return value
        return self.OVERFLOW


def metric_table() -> dict[str, dict[str, Any]]:
    """relay/metrics.toml: each metric's attribute, kind, name, help, labels and the
    docs' words for it."""
    text = (importlib.resources.files("relay") / "metrics.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


class Metrics:
    """Every metric of one relay, declared in relay/metrics.toml and reached as
    attributes of the names there."""

    published: Counter
    duplicates: Counter
    publish_failures: Counter
    dead_marked: Counter
    broker_outage_batches: Counter
    held: Counter
    unpublished: Gauge
    oldest_age: Gauge
    dead_rows: Gauge
    held_subjects: Gauge
    skipped_rows: Gauge
    subjects_without_stream: Gauge
    publish_latency: BatchHistogram
    batch_size: Histogram
    wakeups: Counter
    sleeps: Counter
    retention_deleted: Counter
    late_keys_purged: Counter
    partitions_dropped: Counter
    partitions_held: Gauge
    partitions_created: Counter
    partitions_ahead: Gauge
    partitions_ahead_target: Gauge
    partitions_lock_share: Gauge
    horizon_age: Gauge
    horizon_xids: Gauge
    table_dead_tuples: Gauge
    relays: Gauge
    table_bytes: Gauge
    claims_from_first_entry: Counter
    claims_bounded: Gauge
    claims_past_reach: Gauge
    claims_below_floor: Counter
    table_writers: Gauge
    horizon_holder: Gauge
    database_errors: Counter
    unexpected_errors: Counter
    publish_mode: Gauge
    batch_publishes: Counter
    short_duplicate_windows: Gauge
    audit_missing: Gauge
    audit_duplicate_ids: Gauge
    audit_checked: Gauge
    audit_expired: Gauge
    audit_last_success: Gauge
    audit_failures: Counter
    pacing: Gauge
    listen_connected: Gauge
    schema_rejections: Counter
    schemaless_rows: Counter
    poll_only: Gauge
    nats_connected: Gauge
    up: Gauge
    ready: Gauge
    build: Info

    def set_publish_modes(self, modes: Mapping[str, str]) -> None:
        """Export each stream's publish mode, dropping streams that are gone."""
        self.publish_mode.clear()
        for stream, mode in modes.items():
            self.publish_mode.labels(stream=stream, mode=mode).set(1)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.event_type = BoundedLabel()
        for attribute, spec in metric_table().items():
            setattr(self, attribute, _build(spec, self.registry))
        self.build.info({"version": __version__})
        for reason in ("notify", "poll", "reconnect"):
            self.wakeups.labels(reason=reason)
