"""Postgres helpers for the tests: a database of its own per test, and producers."""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from relay import database as relay_database
from relay.config import Config
from relay.sqlfiles import Names, partition_statement


def with_database(url: str, dbname: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{dbname}"))


def create_database(server_url: str) -> str:
    name = f"relay_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    return with_database(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    name = urllib.parse.urlsplit(url).path.lstrip("/")
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')


def install(url: str, config: Config | None = None) -> None:
    relay_database.install(url, Names.for_config(config or Config()))


# The outbox table's layouts a test can run on (tests/conftest.py's outbox_layout).
LAYOUTS = ("plain", "partitioned")


def install_partitioned(url: str) -> None:
    """The outbox table partitioned by the minute, ten minutes ahead, and one more
    partition for everything before the first minute (tests write old created_at
    values), as a plain table attached as the first partition would be."""
    names = Names.for_config(Config())
    relay_database.install(url, names, partitions=60.0, partitions_ahead=600.0)
    with psycopg.connect(url) as conn:
        conn.execute(partition_statement(names, "readable_bounds"))
        rows = conn.execute(partition_statement(names, "partitions")).fetchall()
        first = min(lower for _, lower, _, _ in rows)
        conn.execute(
            "create table outbox_events_before (like outbox_events including defaults "
            "including constraints including storage)"
        )
        conn.execute(
            sql.SQL(
                "alter table outbox_events attach partition outbox_events_before "
                "for values from (minvalue) to (to_timestamp({}))"
            ).format(sql.Literal(first))
        )


@dataclass
class Event:
    event_type: str
    subject: str
    data: Any = field(default_factory=dict)
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    source: str = "tests"
    time: datetime = field(default_factory=lambda: datetime.now(UTC))


INSERT = (
    "insert into outbox_events (id, event_type, source, subject, time, data) "
    "values (%s, %s, %s, %s, %s, %s)"
)


def insert(url: str, events: Sequence[Event], *, table: str = "outbox_events") -> None:
    """Insert ``events`` in one transaction, the way a producer does."""
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            INSERT.replace("outbox_events", table),
            [(e.id, e.event_type, e.source, e.subject, e.time, json.dumps(e.data)) for e in events],
        )


def insert_in_order(url: str, events: Sequence[Event], *, commit_each: bool = False) -> None:
    """One row at a time, in list order, each with its own created_at
    (clock_timestamp(), even inside one transaction); one transaction for all of
    them, or a commit per row."""
    with psycopg.connect(url) as conn:
        for event in events:
            conn.execute(
                "insert into outbox_events (id, event_type, source, subject, time, data, "
                "created_at) values (%s, %s, 't', %s, now(), %s, clock_timestamp())",
                (event.id, event.event_type, event.subject, json.dumps(event.data)),
            )
            if commit_each:
                conn.commit()


def fetch(url: str, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, tuple(params)).fetchall()


def execute(url: str, sql: str, params: Iterable[Any] = ()) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql, tuple(params))


def rows_by_id(url: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(url) as conn:
        cur = conn.execute(
            # A dead row waits until 'infinity', which no datetime holds: None here,
            # and holds_subject says it.
            "select id::text, event_type, subject, published_at, attempts, "
            "nullif(relay_retry_at, 'infinity') as relay_retry_at, "
            "relay_retry_at = 'infinity' as holds_subject, relay_last_error, relay_dead_at, "
            "relay_skipped_at, created_at from outbox_events"
        )
        cols = [d.name for d in cur.description or ()]
        return {row[0]: dict(zip(cols, row, strict=True)) for row in cur.fetchall()}


def unpublished_count(url: str) -> int:
    return int(fetch(url, "select count(*) from outbox_events where published_at is null")[0][0])


def dead_count(url: str, max_attempts: int) -> int:
    """Unpublished rows at the attempt cap."""
    return int(
        fetch(
            url,
            "select count(*) from outbox_events where published_at is null and attempts >= %s",
            (max_attempts,),
        )[0][0]
    )


def relay_session(url: str) -> psycopg.Connection[Any]:
    """A connection with the relay's session settings (timeouts, planner settings),
    which, as the relay's own, never prepares a statement by itself: psycopg would
    deallocate every prepared statement, the claim's too, at the next rollback."""
    conn = psycopg.connect(url, prepare_threshold=None)
    for name, value in relay_database.Database(Config(database_url=url)).session_settings.items():
        conn.execute("select set_config(%s, %s, false)", (name, value))
    conn.commit()
    return conn
