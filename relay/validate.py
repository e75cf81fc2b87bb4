"""`outbox-relay validate`: the rows already in the table, published or not,
checked against the schemas (relay/schemas.py). A producing service runs it in CI
against its test database; an operator runs it before changing a schema.

It reads through a server-side cursor in a read-only transaction, in bounded
memory, and locks nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import psycopg

from relay.config import Config
from relay.schemas import Schemas
from relay.sqlfiles import Names, query

# Rows fetched per round trip of the cursor.
FETCH_ROWS = 2_000


# Invalid rows the report lists one by one; past these it only counts them, so a
# table of millions of invalid rows is checked in bounded memory.
INVALID_LISTED = 1_000


@dataclass
class ValidationReport:
    checked: int = 0
    invalid: list[dict[str, str]] = field(default_factory=list)  # id, type, reason
    invalid_count: int = 0  # all of them, listed or not
    no_schema: dict[str, int] = field(default_factory=dict)  # event type: rows

    def add_invalid(self, row_id: str, event_type: str, reason: str) -> None:
        self.invalid_count += 1
        if len(self.invalid) < INVALID_LISTED:
            self.invalid.append({"id": row_id, "type": event_type, "reason": reason})

    def as_json(self) -> str:
        return json.dumps(
            {
                "checked": self.checked,
                "invalid_count": self.invalid_count,
                "invalid": self.invalid,
                "no_schema": self.no_schema,
            },
            indent=2,
        )

    def summary(self) -> str:
        lines = [f"{r['id']}  {r['type']}  {r['reason']}" for r in self.invalid]
        if self.invalid_count > len(self.invalid):
            lines.append(f"... and {self.invalid_count - len(self.invalid)} more invalid rows")
        unchecked = sum(self.no_schema.values())
        lines.append(
            f"checked {self.checked} rows: {self.invalid_count} invalid, {unchecked} of "
            f"{len(self.no_schema)} event types without a schema"
            + (f" ({', '.join(sorted(self.no_schema))})" if self.no_schema else "")
        )
        return "\n".join(lines) + "\n"


def check_rows(rows: Any, schemas: Schemas, report: ValidationReport) -> None:
    """Check (id, event_type, data) rows into ``report``, data as jsonb renders it,
    read as the relay's batches read it (relay/jsontext.py)."""
    for row_id, event_type, data in rows:
        report.checked += 1
        if not schemas.covers(event_type):
            report.no_schema[event_type] = report.no_schema.get(event_type, 0) + 1
        problem = schemas.text_problem(event_type, data)
        if problem is not None:
            report.add_invalid(row_id, event_type, problem)


def validate_table(
    conninfo: str, config: Config, schemas: Schemas, since: float | None
) -> ValidationReport:
    """Every row written in the last ``since`` seconds (all, when None)."""
    report = ValidationReport()
    names = Names.for_config(config)
    with psycopg.connect(conninfo) as conn:
        conn.read_only = True
        since_at = None
        if since is not None:
            found = conn.execute(query(names, "validate_since"), {"since": since}).fetchone()
            since_at = found[0] if found else None
        with conn.cursor(name="outbox_relay_validate") as cursor:
            cursor.itersize = FETCH_ROWS
            cursor.execute(query(names, "validate_rows"), {"since": since_at})
            check_rows(cursor, schemas, report)
    return report
