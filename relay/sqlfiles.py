"""SQL is data: every statement lives under ``sql/`` and is loaded from there once.

Identifiers that come from configuration (the table, the channel) are composed
with :mod:`psycopg.sql`, never with string formatting.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path

from psycopg import sql

from relay.claimstart import CLAIM_REACH_MARGIN_SECONDS, LATE_INSERT_SECONDS, StartKey
from relay.config import Config
from relay.errors import ConfigError

_BLOCK = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.MULTILINE)
# A fragment used in a query: {fragment(alias)}, the fragment's {row} being alias.
_FRAGMENT_USE = re.compile(r"\{(\w+)\((\w+)\)\}")


def _sql_root() -> Traversable:
    # A checkout (or editable install) reads the top-level sql/ directly; a wheel
    # carries the same files as relay/sql (see pyproject.toml).
    checkout = Path(__file__).resolve().parent.parent / "sql"
    if (checkout / "queries.sql").is_file():
        return checkout
    return importlib.resources.files("relay") / "sql"


def read_sql(*parts: str) -> str:
    node = _sql_root()
    for part in parts:
        node = node / part
    return node.read_text(encoding="utf-8")


def parse_blocks(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """``-- name: x`` starts query ``x`` and ``-- fragment: x`` a piece of SQL that
    queries use as ``{x(alias)}``; each runs to the next block or the end. A
    fragment's leading comment is left out: it would be sent at every use."""
    named: dict[str, str] = {}
    fragments: dict[str, str] = {}
    matches = list(_BLOCK.finditer(text))
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        body = text[match.end() : end].strip().rstrip(";")
        if match.group(1) == "name":
            named[match.group(2)] = body
        else:
            fragments[match.group(2)] = _LEADING_COMMENT.sub("", body)
    return named, fragments


_LEADING_COMMENT = re.compile(r"\A(?:[ \t]*--[^\n]*\n)+")


def parse_named_blocks(text: str) -> dict[str, str]:
    return parse_blocks(text)[0]


@functools.cache
def _queries_and_fragments() -> tuple[dict[str, str], dict[str, str]]:
    return parse_blocks(read_sql("queries.sql"))


def queries() -> dict[str, str]:
    return _queries_and_fragments()[0]


def install_files() -> list[str]:
    root = _sql_root() / "install"
    names = sorted(entry.name for entry in root.iterdir() if entry.name.endswith(".sql"))
    return [read_sql("install", name) for name in names]


# The relay's advisory locks use the two-key form: this first key marks them as
# the relay's, the second is derived from the table and channel, so relays of two
# outbox tables in one database do not share a sleep lock.
IDLE_LOCK_CLASS = 0x0B0E
# Held by the relay that audits the streams (--audit-interval), so one replica does.
AUDIT_LOCK_CLASS = 0x0B0F
# Held by the relay that creates a partitioned table's partitions, one at a time.
PARTITION_LOCK_CLASS = 0x0B10
# Held shared by every relay of the table on its LISTEN connection while connected:
# counted, it is how many relays share the table (relay/replicas.py).
PRESENCE_LOCK_CLASS = 0x0B11
# Held by the one relay of the table that paces it, on its LISTEN connection: the
# others stand by (relay/scheduler.py, STANDBY_PAUSE).
PACE_LOCK_CLASS = 0x0B12


def idle_lock_key(config: Config) -> int:
    """A stable non-negative int4 (pg_locks shows keys as unsigned oids)."""
    text = f"{config.table_display}\0{config.channel}".encode()
    return zlib.crc32(text) & 0x7FFFFFFF


@dataclass(frozen=True)
class Names:
    """The database objects of one relay installation, as composable SQL."""

    table: sql.Identifier
    unpublished_idx: sql.Identifier
    claim_idx: sql.Identifier
    retry_idx: sql.Identifier
    published_idx: sql.Identifier
    seq: sql.Identifier
    claim_idx_qualified: sql.Identifier
    retry_idx_qualified: sql.Identifier
    # Indexes of earlier installs that install drops (see sql/install/002): the
    # backoff index (predicate: unpublished and in backoff), then the retry index
    # ordered by (subject, created_at, id).
    old_backoff_idx_qualified: sql.Identifier
    old_retry_idx_qualified: sql.Identifier
    published_idx_qualified: sql.Identifier
    notify_function: sql.Identifier
    notify_trigger: sql.Identifier
    late_function: sql.Identifier
    late_trigger: sql.Identifier
    old_late_trigger: sql.Identifier
    revive_trigger: sql.Identifier
    seq_check: sql.Identifier
    late_idx: sql.Identifier
    late_idx_qualified: sql.Identifier
    late_keys: sql.Identifier
    late_keys_idx: sql.Identifier
    late_key_function: sql.Identifier
    late_key_added: sql.Identifier
    late_key_moved: sql.Identifier
    late_key_gone: sql.Identifier
    channel: sql.Literal
    idle_lock_key1: sql.Literal
    idle_lock_key2: sql.Literal
    trigger_name: str
    late_trigger_name: str
    revive_trigger_name: str
    late_key_trigger_names: tuple[str, str, str]  # added, moved, gone
    # The table's schema (empty: the search path's) and name, for its partitions'.
    schema: tuple[str, ...]
    base: str
    # The same objects' names as text literals, for catalog checks (to_regclass).
    catalog_names: dict[str, sql.Literal]
    # Queries without slots, composed once (a batch composed its marks every time).
    composed: dict[str, sql.Composed] = field(default_factory=dict, compare=False, repr=False)
    # The marks' statements as bytes, by name and connection encoding (relay.database).
    encoded: dict[tuple[str, str], bytes] = field(default_factory=dict, compare=False, repr=False)

    @property
    def idle_lock(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(self.idle_lock_key1, self.idle_lock_key2)

    @property
    def audit_lock(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(AUDIT_LOCK_CLASS), self.idle_lock_key2)

    @property
    def partition_lock(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(PARTITION_LOCK_CLASS), self.idle_lock_key2)

    @property
    def presence_lock(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(PRESENCE_LOCK_CLASS), self.idle_lock_key2)

    @property
    def pace_lock(self) -> sql.Composed:
        return sql.SQL("{}, {}").format(sql.Literal(PACE_LOCK_CLASS), self.idle_lock_key2)

    @property
    def display(self) -> str:
        """The table's name as the configuration gave it."""
        return ".".join((*self.schema, self.base))

    def partition(self, name: str) -> sql.Identifier:
        """One of the table's partitions, in the table's schema."""
        return sql.Identifier(*self.schema, name)

    @classmethod
    def for_config(cls, config: Config) -> Names:
        if any("$" in part for part in (*config.table, config.channel)):
            # They are composed into $$-quoted bodies (sql/install), which "$$" ends.
            raise ConfigError(
                "--table/--channel", f"'$' in a name ({config.table_display}, {config.channel})"
            )
        schema = config.table[:-1]
        base = config.table_name
        return cls(
            table=sql.Identifier(*config.table),
            unpublished_idx=sql.Identifier(f"{base}_unpublished_idx"),
            claim_idx=sql.Identifier(f"{base}_relay_claim_idx"),
            retry_idx=sql.Identifier(f"{base}_relay_waiting_idx"),
            published_idx=sql.Identifier(f"{base}_relay_published_idx"),
            seq=sql.Identifier(*schema, f"{base}_relay_seq"),
            claim_idx_qualified=sql.Identifier(*schema, f"{base}_relay_claim_idx"),
            retry_idx_qualified=sql.Identifier(*schema, f"{base}_relay_waiting_idx"),
            old_backoff_idx_qualified=sql.Identifier(*schema, f"{base}_relay_backoff_idx"),
            old_retry_idx_qualified=sql.Identifier(*schema, f"{base}_relay_retry_idx"),
            published_idx_qualified=sql.Identifier(*schema, f"{base}_relay_published_idx"),
            notify_function=sql.Identifier(*schema, f"{base}_relay_notify"),
            notify_trigger=sql.Identifier(f"{base}_relay_notify"),
            late_function=sql.Identifier(*schema, f"{base}_relay_late"),
            # "zz_": row triggers fire in name order, and these must see the row last.
            late_trigger=sql.Identifier(f"zz_{base}_relay_late"),
            old_late_trigger=sql.Identifier(f"{base}_relay_late"),
            revive_trigger=sql.Identifier(f"zz_{base}_relay_revived"),
            seq_check=sql.Identifier(f"{base}_relay_seq_set"),
            late_idx=sql.Identifier(f"{base}_relay_late_idx"),
            late_idx_qualified=sql.Identifier(*schema, f"{base}_relay_late_idx"),
            late_keys=sql.Identifier(*schema, f"{base}_relay_late_keys"),
            late_keys_idx=sql.Identifier(f"{base}_relay_late_keys_idx"),
            late_key_function=sql.Identifier(*schema, f"{base}_relay_late_key"),
            # After the row triggers above, by their names as by their timing.
            late_key_added=sql.Identifier(f"zz_{base}_relay_late_key_added"),
            late_key_moved=sql.Identifier(f"zz_{base}_relay_late_key_moved"),
            late_key_gone=sql.Identifier(f"zz_{base}_relay_late_key_gone"),
            channel=sql.Literal(config.channel),
            idle_lock_key1=sql.Literal(IDLE_LOCK_CLASS),
            idle_lock_key2=sql.Literal(idle_lock_key(config)),
            trigger_name=f"{base}_relay_notify",
            late_trigger_name=f"zz_{base}_relay_late",
            revive_trigger_name=f"zz_{base}_relay_revived",
            late_key_trigger_names=(
                f"zz_{base}_relay_late_key_added",
                f"zz_{base}_relay_late_key_moved",
                f"zz_{base}_relay_late_key_gone",
            ),
            schema=tuple(schema),
            base=base,
            catalog_names={
                "table": sql.Literal(_quoted(*config.table)),
                "unpublished_idx": sql.Literal(_quoted(*schema, f"{base}_unpublished_idx")),
                "claim_idx": sql.Literal(_quoted(*schema, f"{base}_relay_claim_idx")),
                "retry_idx": sql.Literal(_quoted(*schema, f"{base}_relay_waiting_idx")),
                "seq": sql.Literal(_quoted(*schema, f"{base}_relay_seq")),
                "old_backoff_idx": sql.Literal(_quoted(*schema, f"{base}_relay_backoff_idx")),
                "old_retry_idx": sql.Literal(_quoted(*schema, f"{base}_relay_retry_idx")),
                "published_idx": sql.Literal(_quoted(*schema, f"{base}_relay_published_idx")),
                "late_idx": sql.Literal(_quoted(*schema, f"{base}_relay_late_idx")),
                "late_keys": sql.Literal(_quoted(*schema, f"{base}_relay_late_keys")),
                "late_key_function": sql.Literal(_quoted(*schema, f"{base}_relay_late_key")),
                "old_late_trigger": sql.Literal(f"{base}_relay_late"),
                "seq_check": sql.Literal(f"{base}_relay_seq_set"),
            },
        )

    def compose(self, template: str, **slots: sql.Composable) -> sql.Composed:
        return sql.SQL(template).format(
            # created_span: the marks' bound, none unless mark_statement asks.
            **{**CLAIM_PARAMETERS, "created_span": sql.SQL(""), **slots},
            table=self.table,
            table_name=self.catalog_names["table"],
            unpublished_idx_name=self.catalog_names["unpublished_idx"],
            claim_idx_name=self.catalog_names["claim_idx"],
            retry_idx_name=self.catalog_names["retry_idx"],
            seq_name=self.catalog_names["seq"],
            old_backoff_idx_name=self.catalog_names["old_backoff_idx"],
            old_retry_idx_name=self.catalog_names["old_retry_idx"],
            published_idx_name=self.catalog_names["published_idx"],
            trigger_name=sql.Literal(self.trigger_name),
            late_trigger_name=sql.Literal(self.late_trigger_name),
            late_function=self.late_function,
            late_trigger=self.late_trigger,
            old_late_trigger=self.old_late_trigger,
            old_late_trigger_name=self.catalog_names["old_late_trigger"],
            revive_trigger=self.revive_trigger,
            revive_trigger_name=sql.Literal(self.revive_trigger_name),
            seq_check=self.seq_check,
            seq_check_name=self.catalog_names["seq_check"],
            late_idx_name=self.catalog_names["late_idx"],
            late_idx=self.late_idx,
            late_idx_qualified=self.late_idx_qualified,
            late_keys=self.late_keys,
            late_keys_name=self.catalog_names["late_keys"],
            late_keys_idx=self.late_keys_idx,
            late_key_function=self.late_key_function,
            late_key_function_name=self.catalog_names["late_key_function"],
            late_key_added=self.late_key_added,
            late_key_moved=self.late_key_moved,
            late_key_gone=self.late_key_gone,
            late_key_added_name=sql.Literal(self.late_key_trigger_names[0]),
            late_key_moved_name=sql.Literal(self.late_key_trigger_names[1]),
            late_key_gone_name=sql.Literal(self.late_key_trigger_names[2]),
            late_trigger_names=sql.SQL(", ").join(
                sql.Literal(name)
                for name in (
                    self.late_trigger_name,
                    self.revive_trigger_name,
                    *self.late_key_trigger_names,
                )
            ),
            late_trigger_count=sql.Literal(2 + len(self.late_key_trigger_names)),
            late_insert=LATE_INSERT,
            late_trigger_comment=LATE_TRIGGER_COMMENT,
            claim_reach=CLAIM_REACH,
            unpublished_idx=self.unpublished_idx,
            claim_idx=self.claim_idx,
            retry_idx=self.retry_idx,
            published_idx=self.published_idx,
            seq=self.seq,
            claim_idx_qualified=self.claim_idx_qualified,
            retry_idx_qualified=self.retry_idx_qualified,
            old_backoff_idx_qualified=self.old_backoff_idx_qualified,
            old_retry_idx_qualified=self.old_retry_idx_qualified,
            published_idx_qualified=self.published_idx_qualified,
            notify_function=self.notify_function,
            notify_trigger=self.notify_trigger,
            channel=self.channel,
            idle_lock=self.idle_lock,
            audit_lock=self.audit_lock,
            partition_lock=self.partition_lock,
            presence_lock=self.presence_lock,
            presence_lock_key1=sql.Literal(PRESENCE_LOCK_CLASS),
            pace_lock=self.pace_lock,
            idle_lock_key1=self.idle_lock_key1,
            idle_lock_key2=self.idle_lock_key2,
        )


def _quoted(*parts: str) -> str:
    """``"schema"."name"``: an identifier as text, as to_regclass() parses it."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)


def install_script(names: Names) -> list[sql.Composed]:
    return [names.compose(text) for text in install_files()]


def grant_script(names: Names, role: str) -> sql.Composed:
    """The grants a relay running as ``role`` needs (sql/grant.sql)."""
    return names.compose(
        read_sql("grant.sql"), role=sql.Identifier(role), role_name=sql.Literal(role)
    )


@functools.cache
def _partition_statements() -> dict[str, str]:
    return parse_named_blocks(read_sql("partitions.sql"))


def partition_statement(names: Names, name: str, **slots: sql.Composable) -> sql.Composed:
    """Statement ``name`` of sql/partitions.sql, ``slots`` filling its own slots
    (``{partition}``, ``{start}``, ``{end}``)."""
    return names.compose(_partition_statements()[name], **slots)


def migration_statements(names: Names, bound: float) -> dict[str, sql.Composed]:
    """sql/partitions.sql's migration of the plain table, by step: the plain table
    becomes ``{table}_before``, the partition of every created_at before ``bound``
    (epoch seconds)."""
    before = f"{names.base}_before"
    old_indexes = {
        "old_pkey": f"{names.base}_pkey",
        "old_unpublished_idx": f"{names.base}_unpublished_idx",
        "old_claim_idx": f"{names.base}_relay_claim_idx",
        "old_retry_idx": f"{names.base}_relay_waiting_idx",
        "old_published_idx": f"{names.base}_relay_published_idx",
        "old_late_idx": f"{names.base}_relay_late_idx",
    }
    slots: dict[str, sql.Composable] = {
        "bound": sql.SQL("to_timestamp({})").format(sql.Literal(bound)),
        "before": names.partition(before),
        "before_name": sql.Identifier(before),
        "before_bound": sql.Identifier(f"{before}_bound"),
        "before_key": sql.Identifier(f"{before}_key"),
    }
    for slot, old in old_indexes.items():
        slots[slot] = names.partition(old)
        new = old.replace(names.base, before, 1).replace("_relay_", "_", 1)
        slots[slot.replace("old_", "before_", 1)] = sql.Identifier(new)
    steps = ("migration_bound", "migration_validate", "migration_key", "migration_switch")
    return {step: partition_statement(names, step, **slots) for step in steps}


def uninstall_script(names: Names) -> sql.Composed:
    return names.compose(read_sql("uninstall.sql"))


def mark_statement(names: Names, name: str, partitioned: bool) -> sql.Composed:
    """``mark_published`` or ``mark_failed``, bounded by the batch's created_at span
    on a partitioned table (the fragment created_span), composed once each way."""
    if not partitioned:
        return query(names, name)
    key = f"{name} partitioned"
    if (composed := names.composed.get(key)) is None:
        fragment = _queries_and_fragments()[1]["created_span"]
        span = names.compose(fragment, row=sql.Identifier("t"))
        composed = names.composed[key] = query(names, name, created_span=span)
    return composed


def query(
    names: Names, name: str, *, partitioned: bool = False, **slots: sql.Composable
) -> sql.Composed:
    """Query ``name``; ``slots`` fill its ``{slot}`` parameters other than the
    identifiers (the claim's, :data:`CLAIM_PARAMETERS`, and the marks' created_span,
    :func:`mark_statement`), and each
    ``{fragment(alias)}`` is that fragment, about the table's row ``alias`` (also
    inside a fragment). The fragments only a partitioned table's claim needs
    (:data:`PARTITIONED_ONLY`) are their plain text unless ``partitioned``."""
    key = f"{name} partitioned" if partitioned else name
    plain = not slots
    if plain and (composed := names.composed.get(key)) is not None:
        return composed
    queries_, _ = _queries_and_fragments()
    template = queries_[name]
    _compose_fragments(names, template, slots, partitioned)
    statement = names.compose(template, **slots)
    if plain:
        names.composed[key] = statement
    return statement


# Fragments a plain table's claim goes without, and what stands in their place.
PARTITIONED_ONLY = {
    "walk_ceiling": "",
    "rows_beyond": "null",
    "walk_floor": "",
    "floor_refusal": "",
    "refusal": "",
    "refused": "null",
    "dead_below": "",
    "past_dead_below": "",
}


def _compose_fragments(
    names: Names, text: str, slots: dict[str, sql.Composable], partitioned: bool
) -> None:
    """Put each fragment ``text`` uses into ``slots``, those it uses first."""
    fragments = _queries_and_fragments()[1]
    for use in {m.group(0)[1:-1]: m for m in _FRAGMENT_USE.finditer(text)}.values():
        slot = use.group(0)[1:-1]
        if slot in slots:
            continue
        fragment, alias = use.groups()
        if not partitioned and fragment in PARTITIONED_ONLY:
            slots[slot] = sql.SQL(PARTITIONED_ONLY[fragment])
            continue
        inner = dict(slots)
        _compose_fragments(names, fragments[fragment], inner, partitioned)
        slots[slot] = names.compose(fragments[fragment], row=sql.Identifier(alias), **inner)


# How much later than its created_at a row may be inserted and not be flagged late
# (relay/claimstart.py): in the trigger's test, and in the claim's walk back.
# A constant, folded once: make_interval() was evaluated for every inserted row.
LATE_INSERT = sql.SQL("interval {}").format(sql.Literal(f"{LATE_INSERT_SECONDS} seconds"))
# The late-row trigger's comment, which says which of its versions is installed (a
# reinstall makes an older one again).
LATE_TRIGGER_COMMENT = sql.Literal(
    "outbox-relay: flags rows inserted over the late-insert slack after or before their "
    "created_at (2)"
)
# How far past the claim's start its walks reach on a partitioned table: the
# late-insert slack, and a margin for a claim whose snapshot is taken long after
# the statement began (behind a lock), which would see rows inserted meanwhile.
CLAIM_REACH = sql.SQL("interval {}").format(
    sql.Literal(f"{LATE_INSERT_SECONDS + CLAIM_REACH_MARGIN_SECONDS} seconds")
)

# The claim's parameters are slots in sql/queries.sql, not %(name)s: as they are,
# bound parameters; when the relay prepares the claim, $1 to $11, typed in PREPARE.
_CLAIM_PARAMETER_TYPES = {
    "batch_size": "integer",
    "max_attempts": "integer",
    "start_at": "timestamptz",
    "start_seq": "bigint",
    "bound_at": "timestamptz",
    "locks_at": "timestamptz",
    "writer_xids": "xid8[]",
    "writer_since": "timestamptz[]",
    "ceiling": "timestamptz",
    "beyond_from": "timestamptz",
    "floor_cap": "timestamptz",
}
CLAIM_PARAMETERS: dict[str, sql.Composable] = {
    name: sql.Placeholder(name) for name in _CLAIM_PARAMETER_TYPES
}


def claim_parameters(batch_size: int, max_attempts: int, start: StartKey) -> dict[str, object]:
    """The claim's parameters, by name, for running it as it is."""
    return {
        "batch_size": batch_size,
        "max_attempts": max_attempts,
        "start_at": start.start_at,
        "start_seq": start.start_seq,
        "bound_at": start.bound_at,
        "locks_at": start.locks_at,
        "writer_xids": start.writer_xids,
        "writer_since": start.writer_since,
        "ceiling": start.ceiling,
        "beyond_from": start.beyond_from,
        "floor_cap": start.floor_cap,
    }


def claim_preparation(
    names: Names, statement: sql.Identifier, *, partitioned: bool = False
) -> sql.Composed:
    """``PREPARE statement (batch_size, max_attempts, start ...) AS`` the claim (a
    partitioned table's with ``partitioned``)."""
    positions = {name: sql.SQL(f"${i}") for i, name in enumerate(_CLAIM_PARAMETER_TYPES, 1)}
    body = query(names, "claim", partitioned=partitioned, **positions)
    types = sql.SQL(", ").join(sql.SQL(t) for t in _CLAIM_PARAMETER_TYPES.values())
    return sql.SQL("prepare {} ({}) as\n").format(statement, types) + body


def claim_execution(
    statement: sql.Identifier,
    batch_size: int,
    max_attempts: int,
    start: StartKey,
    *,
    begin: bool = True,
    plan_cache_mode: str | None = None,
) -> sql.Composed:
    """Open the batch's transaction and run the prepared claim: one message, one
    round trip (without ``begin``, the claim alone, in the transaction open).

    With ``plan_cache_mode`` (a partitioned table's claim: force_generic_plan), that
    setting holds for the claim alone, set before it and back to the server's after
    it: Postgres would plan the first five executions with their values, and five
    again after each invalidation, which every new or dropped partition is, each
    costing several runs of the generic plan (docs/partitions.md); the marks and the
    other tasks' statements are planned with their values, as they should be."""
    values = claim_parameters(batch_size, max_attempts, start).values()
    return _claim_execution(statement, [sql.Literal(v) for v in values], begin, plan_cache_mode)


def claim_execution_template(
    statement: sql.Identifier, *, begin: bool = True, plan_cache_mode: str | None = None
) -> sql.Composed:
    """:func:`claim_execution` with a ``%s`` for each of :func:`claim_parameters`'
    values, in their order: composed once, its values bound each claim."""
    placeholders = [sql.Placeholder() for _ in _CLAIM_PARAMETER_TYPES]
    return _claim_execution(statement, placeholders, begin, plan_cache_mode)


def _claim_execution(
    statement: sql.Identifier,
    values: list[sql.Literal] | list[sql.Placeholder],
    begin: bool,
    plan_cache_mode: str | None,
) -> sql.Composed:
    execution = sql.SQL("execute {} ({})").format(statement, sql.SQL(", ").join(values))
    if plan_cache_mode is not None:
        execution = sql.SQL(
            "set local plan_cache_mode = {}; {}; set local plan_cache_mode = default"
        ).format(sql.SQL(plan_cache_mode), execution)
    return sql.SQL("begin; ") + execution if begin else execution


def local_settings(settings: Mapping[str, str]) -> sql.Composed:
    """One statement that sets ``settings`` for the current transaction only (as SET
    LOCAL does): behind a transaction pooler a session setting would stay on a
    server connection other clients get next."""
    calls = sql.SQL(", ").join(
        sql.SQL("set_config({}, {}, true)").format(sql.Literal(name), sql.Literal(value))
        for name, value in settings.items()
    )
    return sql.SQL("select {}").format(calls)


def claim_with_values(
    names: Names,
    batch_size: int,
    max_attempts: int,
    start: StartKey,
    *,
    partitioned: bool = False,
) -> sql.Composed:
    """The claim with its values in place of its parameters (typed as the prepared
    claim's are), to send as one statement among others."""
    values = claim_parameters(batch_size, max_attempts, start)
    inline = {
        name: sql.SQL("({})::{}").format(sql.Literal(values[name]), sql.SQL(kind))
        for name, kind in _CLAIM_PARAMETER_TYPES.items()
    }
    return query(names, "claim", partitioned=partitioned, **inline)


def claim_unprepared(
    names: Names,
    batch_size: int,
    max_attempts: int,
    start: StartKey,
    settings: Mapping[str, str],
    *,
    partitioned: bool = False,
) -> sql.Composed:
    """For a transaction pooler, where a prepared statement lives on one server
    connection and the next transaction may get another: open the transaction, set
    its settings, and run the claim with its values in place, in one message."""
    return sql.SQL("begin; {}; ").format(local_settings(settings)) + claim_with_values(
        names, batch_size, max_attempts, start, partitioned=partitioned
    )
