"""Operator commands: `status` (what is stuck, and since when) and `requeue`
(give dead rows another go once the cause is fixed)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any
from uuid import UUID

import psycopg

from relay.config import Config
from relay.sqlfiles import Names, query


@dataclass(frozen=True)
class TypeBacklog:
    event_type: str
    unpublished: int
    dead: int
    backing_off: int
    oldest_age_seconds: float
    max_attempts: int
    last_error: str | None


def read_status(conninfo: str, config: Config) -> list[TypeBacklog]:
    names = Names.for_config(config)
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(query(names, "status"), {"max_attempts": config.max_attempts})
        return [TypeBacklog(*row) for row in rows.fetchall()]


def format_age(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def render_status(backlog: Sequence[TypeBacklog], config: Config) -> str:
    if not backlog:
        return f"{config.table_display}: nothing unpublished\n"
    header = ("EVENT TYPE", "UNPUBLISHED", "DEAD", "BACKING OFF", "OLDEST", "MAX ATTEMPTS")
    rows = [
        (
            b.event_type or "(empty)",
            str(b.unpublished),
            str(b.dead),
            str(b.backing_off),
            format_age(b.oldest_age_seconds),
            f"{b.max_attempts}/{config.max_attempts}",
        )
        for b in backlog
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    ]
    total = sum(b.unpublished for b in backlog)
    dead = sum(b.dead for b in backlog)
    lines.append(
        f"\n{total} unpublished, {dead} dead (at the cap of {config.max_attempts} attempts)"
    )
    errors = [(b.event_type, b.last_error) for b in backlog if b.last_error]
    if errors:
        lines.append("\nlast errors:")
        lines.extend(f"  {event_type or '(empty)'}: {error}" for event_type, error in errors)
    return "\n".join(lines) + "\n"


def status_json(backlog: Sequence[TypeBacklog]) -> str:
    return json.dumps([asdict(b) for b in backlog], indent=2) + "\n"


@dataclass(frozen=True)
class RequeueResult:
    matched: list[dict[str, Any]]
    reset: int


def requeue(
    conninfo: str,
    config: Config,
    *,
    ids: Sequence[UUID],
    event_types: Sequence[str],
    all_dead: bool,
    execute: bool,
) -> RequeueResult:
    """Select the rows, and reset them only when ``execute``; one transaction."""
    names = Names.for_config(config)
    with psycopg.connect(conninfo) as conn:
        found = conn.execute(
            query(names, "requeue_select"),
            {
                "ids": list(ids),
                "event_types": list(event_types),
                "all_dead": all_dead,
                "max_attempts": config.max_attempts,
            },
        ).fetchall()
        matched = [
            {"id": str(r[0]), "event_type": r[1], "attempts": r[2], "last_error": r[3]}
            for r in found
        ]
        reset = 0
        if execute and found:
            cursor = conn.execute(query(names, "requeue_reset"), {"ids": [r[0] for r in found]})
            reset = cursor.rowcount
            # Relays waiting for work wake now instead of at their next poll.
            conn.execute(query(names, "wake_relays"), {"channel": config.channel})
        conn.commit()
    return RequeueResult(matched, reset)
