"""Prometheus metrics. One registry per relay, so tests can run several in a process."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping

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
    in Python for every value: 3.6 us a row here, about 6% of the relay's CPU while
    it drains. This one bins a batch with ``bisect`` and is read by the registry like
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


class Metrics:
    def set_publish_modes(self, modes: Mapping[str, str]) -> None:
        """Export each stream's publish mode, dropping streams that are gone."""
        self.publish_mode.clear()
        for stream, mode in modes.items():
            self.publish_mode.labels(stream=stream, mode=mode).set(1)

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.event_type = BoundedLabel()
        r = self.registry
        self.published = Counter(
            "outbox_relay_published",
            "Rows published and acknowledged by JetStream",
            ["event_type"],
            registry=r,
        )
        self.duplicates = Counter(
            "outbox_relay_duplicate_acks",
            "Acks with duplicate=true: the stream already had the message",
            registry=r,
        )
        self.publish_failures = Counter(
            "outbox_relay_publish_failures",
            "Failed publishes, by reason",
            ["event_type", "reason"],
            registry=r,
        )
        self.dead_marked = Counter(
            "outbox_relay_dead_marked",
            "Rows this relay moved to the attempt cap",
            ["event_type", "reason"],
            registry=r,
        )
        self.broker_outage_batches = Counter(
            "outbox_relay_broker_outage_batches",
            "Batches the broker acknowledged none of; their rows were left as they were",
            registry=r,
        )
        self.held = Counter(
            "outbox_relay_held_rows",
            "Claimed rows left for later because an earlier row of their subject was not "
            "yet published",
            registry=r,
        )
        self.unpublished = Gauge(
            "outbox_relay_unpublished_rows", "Rows not yet published (table-wide)", registry=r
        )
        self.oldest_age = Gauge(
            "outbox_relay_oldest_unpublished_age_seconds",
            "Age of the oldest unpublished row that is not dead (table-wide)",
            registry=r,
        )
        self.dead_rows = Gauge(
            "outbox_relay_dead_rows",
            "Dead rows: unpublished, given up on by the relay, each holding back the later rows "
            "of its subject (table-wide)",
            registry=r,
        )
        self.held_subjects = Gauge(
            "outbox_relay_held_subjects",
            "Subjects whose later rows wait behind a dead row (table-wide)",
            registry=r,
        )
        self.skipped_rows = Gauge(
            "outbox_relay_skipped_rows",
            "Rows an operator gave up on with `outbox-relay skip`: kept, unpublished (table-wide)",
            registry=r,
        )
        self.subjects_without_stream = Gauge(
            "outbox_relay_subjects_without_stream",
            "Event types (NATS subjects) this relay met that no stream captures; their rows wait",
            registry=r,
        )
        self.publish_latency = BatchHistogram(
            "outbox_relay_publish_latency_seconds",
            "From the row's created_at to the broker's ack",
            LATENCY_BUCKETS,
            r,
        )
        self.batch_size = Histogram(
            "outbox_relay_batch_size", "Rows claimed per pass", buckets=BATCH_BUCKETS, registry=r
        )
        self.wakeups = Counter(
            "outbox_relay_wakeups",
            "Claim passes started, by what woke the relay",
            ["reason"],
            registry=r,
        )
        self.sleeps = Counter(
            "outbox_relay_sleeps",
            "Times the publisher drained the table and slept until woken",
            registry=r,
        )
        self.retention_deleted = Counter(
            "outbox_relay_retention_deleted", "Spent rows deleted by retention", registry=r
        )
        self.database_errors = Counter(
            "outbox_relay_database_errors",
            "Database operations that failed, by task",
            ["task"],
            registry=r,
        )
        self.publish_mode = Gauge(
            "outbox_relay_publish_mode",
            "1 for the mode the relay publishes into each stream with (batch, atomic, "
            "message; --publish-mode and what the stream allows decide)",
            ["stream", "mode"],
            registry=r,
        )
        self.batch_publishes = Counter(
            "outbox_relay_batch_publishes",
            "Batch publishes (--publish-mode), by outcome: stored (every message), stopped "
            "(at a message the stream refused), unanswered (a timeout, the broker's "
            "failure), turned_down (as a batch: a duplicate in an atomic batch, batching "
            "disabled; the messages then went one by one)",
            ["mode", "outcome"],
            registry=r,
        )
        self.short_duplicate_windows = Gauge(
            "outbox_relay_streams_short_duplicate_window",
            "Streams whose duplicate window is shorter than --backoff-max + --publish-timeout "
            "(read when the relay first connects to NATS)",
            registry=r,
        )
        self.audit_missing = Gauge(
            "outbox_relay_audit_missing_rows",
            "Rows marked published whose message their stream no longer holds, at the last "
            "audit (--audit-interval)",
            registry=r,
        )
        self.audit_checked = Gauge(
            "outbox_relay_audit_checked_rows", "Rows the last audit compared", registry=r
        )
        self.audit_expired = Gauge(
            "outbox_relay_audit_expired_rows",
            "Rows whose message the last audit found removed by its stream's limits",
            registry=r,
        )
        self.audit_last_success = Gauge(
            "outbox_relay_audit_last_success_timestamp_seconds",
            "When the last audit finished (unix time)",
            registry=r,
        )
        self.audit_failures = Counter(
            "outbox_relay_audit_failures", "Audits that could not finish", registry=r
        )
        self.listen_connected = Gauge(
            "outbox_relay_listen_connected", "1 while the LISTEN connection is up", registry=r
        )
        self.nats_connected = Gauge(
            "outbox_relay_nats_connected", "1 while connected to NATS", registry=r
        )
        self.up = Gauge("outbox_relay_up", "1 while the relay runs", registry=r)
        self.ready = Gauge("outbox_relay_ready", "1 while /readyz answers 200", registry=r)
        self.build = Info("outbox_relay_build", "Build information", registry=r)
        self.build.info({"version": __version__})
        for reason in ("notify", "poll", "reconnect"):
            self.wakeups.labels(reason=reason)
