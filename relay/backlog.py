"""Operator commands: `status` (what is stuck, and since when), `requeue` (give dead
rows another go once the cause is fixed) and `skip` (give up on a row for good,
keeping it, so that its subject moves on)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from relay.config import Config
from relay.horizon import Holder, advice, describe, read_holders
from relay.sqlfiles import Names, query


@dataclass(frozen=True)
class TypeBacklog:
    event_type: str
    unpublished: int
    dead: int
    skipped: int
    backing_off: int
    oldest_age_seconds: float
    max_attempts: int
    last_error: str | None


@dataclass(frozen=True)
class HeldSubject:
    """A subject whose later rows wait behind a dead row of it."""

    subject: str
    dead: int
    waiting: int  # live rows behind the dead ones
    first_dead_id: str
    error: str | None


@dataclass(frozen=True)
class VacuumHorizon:
    """What holds the vacuum horizon back, oldest first, and what it has cost."""

    holders: list[Holder]
    dead_tuples: int
    total_bytes: int


@dataclass(frozen=True)
class Status:
    backlog: list[TypeBacklog]
    held: list[HeldSubject]
    horizon: VacuumHorizon


# Holders of the horizon `status` names, and from how old on.
HORIZON_HOLDERS_SHOWN = 3
HORIZON_SHOWN_FROM = 60.0


HELD_SUBJECTS_SHOWN = 50


def read_status(conninfo: str, config: Config) -> Status:
    names = Names.for_config(config)
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(query(names, "status"), {"max_attempts": config.max_attempts})
        backlog = [TypeBacklog(*row) for row in rows.fetchall()]
        rows = conn.execute(
            query(names, "held_subjects"),
            {"max_attempts": config.max_attempts, "limit": HELD_SUBJECTS_SHOWN},
        )
        held = [
            HeldSubject(subject, dead, waiting, str(first), error)
            for subject, dead, waiting, first, error in rows.fetchall()
        ]
        table = sql.Identifier(*config.table).as_string()
        dead_tuples, total_bytes, _, _ = conn.execute(
            query(names, "table_health"), {"table": table}
        ).fetchall()[0]
        holders = read_holders(
            conn.execute(
                query(names, "horizon_holders"), {"limit": HORIZON_HOLDERS_SHOWN, "table": table}
            ).fetchall()
        )
    return Status(backlog, held, VacuumHorizon(holders, dead_tuples, total_bytes))


def render_horizon(horizon: VacuumHorizon, shown_from: float = HORIZON_SHOWN_FROM) -> list[str]:
    """The holders of the vacuum horizon older than ``shown_from`` seconds (or hidden
    from this role), one line each, and what to do."""
    shown = [h for h in horizon.holders if not h.visible or (h.seconds or 0.0) >= shown_from]
    if not shown:
        return []
    lines = [
        f"\nvacuum horizon: {horizon.dead_tuples} dead tuples, table and indexes "
        f"{horizon.total_bytes / 1e6:.0f} MB; no vacuum may remove them while it is"
    ]
    lines.extend("  " + describe(h, h.seconds or 0.0) for h in shown)
    lines.extend("  " + line for line in advice(shown))
    lines.append(
        "  ending it lets vacuum reclaim them; the relay's claims do not slow down meanwhile"
    )
    return lines


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


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]


def render_status(status: Status, config: Config) -> str:
    backlog = status.backlog
    if not backlog:
        horizon = render_horizon(status.horizon)
        return "\n".join([f"{config.table_display}: nothing unpublished", *horizon]) + "\n"
    header = (
        "EVENT TYPE", "UNPUBLISHED", "DEAD", "SKIPPED", "BACKING OFF", "OLDEST", "MAX ATTEMPTS"
    )  # fmt: skip
    rows = [
        (
            b.event_type or "(empty)",
            str(b.unpublished),
            str(b.dead),
            str(b.skipped),
            str(b.backing_off),
            format_age(b.oldest_age_seconds),
            f"{b.max_attempts}/{config.max_attempts}",
        )
        for b in backlog
    ]
    lines = _table(header, rows)
    total = sum(b.unpublished for b in backlog)
    dead = sum(b.dead for b in backlog)
    skipped = sum(b.skipped for b in backlog)
    lines.append(
        f"\n{total} unpublished, {dead} dead (each holds back the later rows of its subject), "
        f"{skipped} skipped"
    )
    if status.held:
        shown = "" if len(status.held) < HELD_SUBJECTS_SHOWN else f" (first {HELD_SUBJECTS_SHOWN})"
        lines.append(f"\nheld subjects{shown}: `requeue` the dead row once its cause is fixed, "
                     "or `skip` it to let the subject move on without it")  # fmt: skip
        lines.extend(
            "  " + line
            for line in _table(
                ("SUBJECT", "DEAD", "WAITING BEHIND", "FIRST DEAD ROW", "ERROR"),
                [
                    (h.subject, str(h.dead), str(h.waiting), h.first_dead_id, h.error or "")
                    for h in status.held
                ],
            )
        )
    errors = [(b.event_type, b.last_error) for b in backlog if b.last_error]
    if errors:
        lines.append("\nlast errors:")
        lines.extend(f"  {event_type or '(empty)'}: {error}" for event_type, error in errors)
    lines.extend(render_horizon(status.horizon))
    return "\n".join(lines) + "\n"


def status_json(status: Status) -> str:
    return json.dumps(asdict(status), indent=2) + "\n"


def _select_then_change(
    conninfo: str,
    config: Config,
    *,
    select: str,
    params: dict[str, Any],
    change: str,
    execute: bool,
) -> tuple[list[tuple[Any, ...]], int]:
    """One transaction: the rows ``select`` finds (locking them), then, only when
    ``execute``, ``change`` applied to their ids and the relays woken (they go on at
    once instead of at their next poll). The rows found and how many changed."""
    names = Names.for_config(config)
    with psycopg.connect(conninfo) as conn:
        found = conn.execute(query(names, select), params).fetchall()
        changed = 0
        if execute and found:
            cursor = conn.execute(query(names, change), {"ids": [r[0] for r in found]})
            changed = cursor.rowcount
            conn.execute(query(names, "wake_relays"), {"channel": config.channel})
        conn.commit()
    return found, changed


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
    """Select the rows, and reset them only when ``execute``."""
    found, reset = _select_then_change(
        conninfo,
        config,
        select="requeue_select",
        params={
            "ids": list(ids),
            "event_types": list(event_types),
            "all_dead": all_dead,
            "max_attempts": config.max_attempts,
        },
        change="requeue_reset",
        execute=execute,
    )
    matched = [
        {"id": str(r[0]), "event_type": r[1], "attempts": r[2], "last_error": r[3],
         "skipped": r[4]}
        for r in found
    ]  # fmt: skip
    return RequeueResult(matched, reset)


@dataclass(frozen=True)
class SkipResult:
    matched: list[dict[str, Any]]
    skipped: int


def skip(conninfo: str, config: Config, *, ids: Sequence[UUID], execute: bool) -> SkipResult:
    """Select the rows, and skip them only when ``execute``. The select waits for a
    batch in flight that holds one of them (it may be publishing it right now)."""
    found, skipped = _select_then_change(
        conninfo,
        config,
        select="skip_select",
        params={"ids": list(ids), "max_attempts": config.max_attempts},
        change="skip_mark",
        execute=execute,
    )
    matched = [
        {"id": str(r[0]), "event_type": r[1], "subject": r[2], "attempts": r[3],
         "last_error": r[4], "dead": r[5]}
        for r in found
    ]  # fmt: skip
    return SkipResult(matched, skipped)


def render_skip(result: SkipResult, ids: Sequence[UUID], *, execute: bool) -> str:
    lines = [
        f"{row['id']}  {row['event_type'] or '(empty)'}  subject={row['subject']}  "
        f"attempts={row['attempts']}  {'dead' if row['dead'] else 'not dead'}  "
        f"{row['last_error'] or ''}".rstrip()
        for row in result.matched
    ]
    found = {row["id"] for row in result.matched}
    lines.extend(
        f"{row_id}  not skipped: no such unpublished row, or skipped already"
        for row_id in map(str, ids)
        if row_id not in found
    )
    if execute:
        lines.append(f"skipped {result.skipped} rows: kept in the table, unpublished; "
                     "their subjects move on without them")  # fmt: skip
    else:
        lines.append(f"{len(result.matched)} rows would be skipped (dry run: add --execute)")
    return "\n".join(lines) + "\n"
