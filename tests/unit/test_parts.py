"""Small parts: SQL loading, health, HTTP answers, the wake-up, log lines, metrics."""

from __future__ import annotations

import json
import logging

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from psycopg import sql
from psycopg._queries import PostgresClientQuery
from psycopg.adapt import Transformer

from relay.claimstart import FROM_FIRST_ENTRY, MIN_SEQ, StartKey
from relay.config import Config, parse_channel, parse_table_name
from relay.database import Database
from relay.errors import ConfigError
from relay.health import Health
from relay.httpserver import HttpServer, parse_request_line
from relay.logs import JsonFormatter, TextFormatter
from relay.metrics import LATENCY_BUCKETS, BatchHistogram, BoundedLabel, Metrics, metric_table
from relay.poolers import pooled_from_config
from relay.sqlfiles import (
    Names,
    claim_execution,
    claim_execution_template,
    claim_parameters,
    claim_preparation,
    claim_unprepared,
    grant_script,
    install_script,
    parse_named_blocks,
    queries,
    query,
    uninstall_script,
)
from relay.wakeup import Wakeup


def test_named_blocks():
    text = "-- a comment\n-- name: one\nselect 1;\n\n-- name: two\n-- why\nselect 2;\n"
    assert parse_named_blocks(text) == {"one": "select 1", "two": "-- why\nselect 2"}


def test_every_query_composes_with_configured_identifiers():
    names = Names.for_config(Config(table=("billing", "Outbox"), channel="Wake_Up"))
    for name in queries():
        text = query(names, name).as_string()
        assert "{" not in text.replace("'{}'", "")
    claim = query(names, "claim").as_string()
    assert '"billing"."Outbox"' in claim
    scripts = " ".join(s.as_string() for s in install_script(names))
    assert "pg_notify('Wake_Up', '')" in scripts
    assert '"Outbox_unpublished_idx"' in scripts
    assert '"billing"."Outbox_relay_notify"()' in scripts
    assert "drop table" not in uninstall_script(names).as_string().lower()


def test_the_claim_prepares_with_positional_parameters_and_runs_with_literals():
    names = Names.for_config(Config(table=("billing", "Outbox")))
    statement = sql.Identifier("outbox_relay_claim")
    prepared = claim_preparation(names, statement).as_string()
    assert prepared.startswith(
        'prepare "outbox_relay_claim" (integer, integer, timestamptz, bigint, timestamptz, '
        "timestamptz, xid8[], timestamptz[], timestamptz, timestamptz, timestamptz) as\n"
    )
    assert "%(" not in prepared
    assert prepared.count("$1") == 2  # batch_size: the horizon's offset, the limit
    # max_attempts: the horizon and the claim, both walks ahead (the probes for an
    # earlier waiting row of a subject need none: a dead row waits for good)
    assert prepared.count("$2") == 4
    # the start key once, in walk_from; each part of the bound once, in "bound"
    assert [prepared.count(f"${i}") for i in (3, 4, 5, 6, 7, 8)] == [1, 1, 1, 1, 1, 1]
    # a plain table's walks have no ceiling and no floor, and its claim looks for
    # nothing beyond
    assert [prepared.count(f"${i}") for i in (9, 10, 11)] == [0, 0, 0]
    assert "floor_refusal" not in prepared
    assert '"billing"."Outbox"' in prepared
    start = StartKey("2026-12-04 10:00:00.000001+00", 7, "2026-12-04 10:00:01+00")
    assert claim_execution(statement, 500, 20, start).as_string() == (
        "begin; execute \"outbox_relay_claim\" (500, 20, '2026-12-04 10:00:00.000001+00', 7, "
        "'2026-12-04 10:00:01+00', '-infinity', '{}', '{}', 'infinity', 'infinity', "
        "'-infinity')"
    )
    # A partitioned table's, on its generic plan alone.
    generic = claim_execution(statement, 500, 20, start, plan_cache_mode="force_generic_plan")
    assert generic.as_string().startswith(
        "begin; set local plan_cache_mode = force_generic_plan; execute "
    )
    assert generic.as_string().endswith("; set local plan_cache_mode = default")
    # Within the transaction open (a claim run again without its floor): no BEGIN.
    assert (
        claim_execution(statement, 500, 20, start, begin=False)
        .as_string()
        .startswith('execute "outbox_relay_claim" (500, 20, ')
    )


@pytest.mark.parametrize(
    "how", [{}, {"begin": False}, {"plan_cache_mode": "force_generic_plan"}], ids=str
)
def test_the_claims_template_with_its_values_bound_is_the_claim_composed_with_literals(how):
    # The relay binds the values into a template composed once (relay.database): the
    # same bytes as the claim composed with its values, quotes and all.
    statement = sql.Identifier("outbox_relay_claim")
    start = StartKey(
        "2026-12-04 10:00:00.000001+00", 7, "2026-12-04 10:00:01+00",
        "2026-12-04 09:59:00+00", "{12,13}", '{"2026-12-04 09:58:00+00","it\'s"}',
        ceiling="-infinity",
    )  # fmt: skip
    bound = PostgresClientQuery(Transformer())
    template = claim_execution_template(statement, **how).as_bytes(None)
    bound.convert(template, tuple(claim_parameters(500, 20, start).values()))
    assert bound.query == claim_execution(statement, 500, 20, start, **how).as_bytes(None)
    assert b"it''s" in bound.query


def test_a_partitioned_tables_claim_bounds_every_walk_by_the_ceiling():
    names = Names.for_config(Config())
    prepared = claim_preparation(names, sql.Identifier("c"), partitioned=True).as_string()
    # every reference to the table: the late rows', the start's, the horizon's, the
    # claimed rows', both walks ahead, and the probe for a waiting row (in two scans)
    assert prepared.count("greatest(statement_timestamp() + interval '61.0 seconds', $9)") == 8
    assert prepared.count("$10") == 1  # the look beyond, in the summary
    # The walks from the start (the start's, the horizon's, the claimed rows', both
    # walks ahead) and the probe for a waiting row (in two scans) begin at the floor;
    # the refusal compares the walks' start with it, and the dead rows' subjects are
    # read below it. Not the late rows' lookup: those may lie anywhere.
    floor = (
        "least(least($3::timestamptz,\n      greatest($5::timestamptz, $6::timestamptz) - "
        "interval '1.0 seconds')\n  - interval '61.0 seconds', $11)"
    )
    assert prepared.count(floor) == 9
    assert prepared.count("$11") == 9
    assert "not (select refused from floor_refusal)" in prepared
    assert prepared.count("in (select subject from dead_below)) is not true") == 2
    assert "{" not in prepared.replace("'{}'", "").replace("'{{}}'", "")


def test_behind_a_transaction_pooler_the_claim_is_one_message_with_its_values():
    names = Names.for_config(Config())
    text = claim_unprepared(
        names, 500, 20, FROM_FIRST_ENTRY, {"lock_timeout": "5000", "enable_bitmapscan": "off"}
    ).as_string()
    assert text.startswith(
        "begin; select set_config('lock_timeout', '5000', true), "
        "set_config('enable_bitmapscan', 'off', true); "
    )
    assert "$1" not in text
    assert "%(" not in text
    assert "prepare" not in text.lower()
    # The smallest bigint, typed as the prepared claim's parameter is: parenthesised,
    # or the cast would apply before the minus and overflow.
    assert f"( {MIN_SEQ})::bigint" in text
    assert "('-infinity')::timestamptz" in text


@pytest.mark.parametrize(
    ("settings", "pooled"),
    [
        ({}, None),  # auto, one URL: the LISTEN self-check tells
        ({"listen_database_url": "postgresql://direct/db"}, True),
        ({"poll_only": True}, True),
        ({"database_pooler": "transaction"}, True),
        ({"database_pooler": "session", "listen_database_url": "postgresql://d/db"}, False),
        ({"database_pooler": "none", "poll_only": True}, False),
    ],
)
def test_whether_the_database_url_is_taken_for_a_transaction_pooler(settings, pooled):
    assert pooled_from_config(Config(**settings)) is pooled


def test_a_self_check_that_hears_overrules_one_that_did_not_but_never_the_configuration():
    database = Database(Config())
    assert database.pooled is None
    database.learn_pooler(True)  # the first check heard nothing (a restart, a lost one)
    assert database.pooled is True
    database.learn_pooler(False)  # a later one heard: no transaction pooler
    assert database.pooled is False
    database.learn_pooler(True)  # not hearing proves nothing once one was heard
    assert database.pooled is False
    configured = Database(Config(database_pooler="transaction"))
    configured.learn_pooler(False)
    assert configured.pooled is True


def test_configured_names_cannot_break_out_of_their_quotes():
    # A table or channel name is data, never SQL: quotes are doubled, so no name can
    # end its identifier or literal early and add a statement of its own.
    names = Names.for_config(
        Config(table=('we"ird', 'x"; drop table t; --'), channel="it's; drop table t")
    )
    claim = query(names, "claim").as_string()
    assert '"we""ird"."x""; drop table t; --"' in claim
    # The claim's guard names the late-row triggers, derived from the table's name,
    # as literals: inside single quotes, which the name has none of to end early.
    in_quotes = claim.count('"x""; drop table t; --') + claim.count("'zz_x\"; drop table t; --_")
    assert claim.count("drop table t") == in_quotes
    scripts = " ".join(s.as_string() for s in install_script(names))
    assert "pg_notify('it''s; drop table t', '')" in scripts
    assert "'it's" not in scripts


def test_a_role_to_grant_to_cannot_break_out_of_its_quotes():
    role = "x\"; drop table t; --'$$"
    script = grant_script(Names.for_config(Config()), role).as_string()
    assert 'to "x""; drop table t; --\'$$";' in script  # the identifier, quotes doubled
    assert "'x\"; drop table t; --''$$'" in script  # the literal, outside the $$ block
    body = script[script.index("do $$") : script.index("\n$$;")]
    assert "drop table" not in body  # the block reads the role from a setting


def test_default_install_uses_the_contract_names():
    scripts = " ".join(s.as_string() for s in install_script(Names.for_config(Config())))
    assert 'create table if not exists "outbox_events"' in scripts
    assert 'create index "outbox_events_unpublished_idx"' in scripts
    assert "to_regclass('\"outbox_events_unpublished_idx\"')" in scripts
    assert "where published_at is null" in scripts


@pytest.mark.parametrize(
    ("health", "reason"),
    [
        (Health(database=True, listening=True, broker=True), None),
        (Health(database=False, listening=True, broker=True), "Postgres is unreachable"),
        (Health(database=True, listening=False, broker=True), "LISTEN connection is down"),
        (Health(database=True, listening=True, broker=False), "NATS is not connected"),
        (
            Health(
                database=True,
                listening=True,
                broker=True,
                broker_acking=False,
                broker_problem="no_responders x 3",
            ),
            "NATS acknowledges no publish (no_responders x 3): "
            "the rows wait, their attempts untouched",
        ),
        (Health(database=True, listening=True, broker=True, stopping=True), "shutting down"),
        (Health(setup_problem="no table"), "no table"),
    ],
)
def test_readiness_reasons(health, reason):
    assert health.not_ready_reason() == reason


def test_http_routes():
    server = HttpServer({"/readyz": lambda: (503, "text/plain", b"not ready: x\n")})
    assert server.answer("GET", "/readyz").startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert server.answer("GET", "/readyz").endswith(b"\r\n\r\nnot ready: x\n")
    assert server.answer("HEAD", "/readyz").endswith(b"\r\n\r\n")
    assert server.answer("GET", "/nope").startswith(b"HTTP/1.1 404")
    assert server.answer("POST", "/readyz").startswith(b"HTTP/1.1 405")
    assert parse_request_line(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n") == (
        "GET",
        "/metrics",
    )
    assert parse_request_line(b"garbage") is None


def test_wakeup_coalesces_reasons_and_waits_on_a_virtual_clock():
    async def main():
        wakeup = Wakeup()
        wakeup.set("notify")
        wakeup.set("notify")
        wakeup.set("poll")
        assert await wakeup.wait() == {"notify", "poll"}
        with trio.move_on_after(30) as scope:  # virtual: costs no real time
            await wakeup.wait()
        assert scope.cancelled_caught
        async with trio.open_nursery() as nursery:

            async def later():
                await trio.sleep(5)
                wakeup.set("reconnect")

            nursery.start_soon(later)
            start = trio.current_time()
            assert await wakeup.wait() == {"reconnect"}
            assert trio.current_time() - start == pytest.approx(5)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_json_log_lines_carry_fields():
    record = logging.makeLogRecord(
        {
            "msg": "publish failed: %s",
            "args": ("slow",),
            "levelname": "WARNING",
            "name": "relay",
            "row_id": "r1",
            "event_type": "a.b",
            "reason": "timeout",
        }
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "publish failed: slow"
    assert (line["row_id"], line["event_type"], line["reason"]) == ("r1", "a.b", "timeout")
    text = TextFormatter().format(record)
    assert "row_id=r1" in text
    assert "reason=timeout" in text


def test_event_type_labels_are_bounded():
    label = BoundedLabel(limit=2)
    assert [label(v) for v in ("a", "b", "a", "c", "d", "b")] == [
        "a",
        "b",
        "a",
        "_other",
        "_other",
        "b",
    ]


def test_batch_histogram_exposes_what_a_prometheus_histogram_would():
    values = [0.0, 0.001, 0.0015, 0.002, 0.05, 0.0500001, 3.0, 299.9, 300.0, 4000.0, 0.2]
    reference_registry, batch_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("t_seconds", "doc", buckets=LATENCY_BUCKETS, registry=reference_registry)
    batch = BatchHistogram("t_seconds", "doc", LATENCY_BUCKETS, batch_registry)
    for value in values:
        reference.observe(value)
    batch.observe_many(values[:4])
    batch.observe_many([])
    batch.observe_many(values[4:])
    assert generate_latest(batch_registry) == generate_latest(reference_registry)


def test_nats_auth_becomes_nats_py_connect_options():
    from relay.broker import nats_auth_options  # noqa: PLC0415 - one test's import

    assert nats_auth_options(Config()) == {}
    options = nats_auth_options(Config(nats_creds="/run/secrets/relay.creds", nats_token="t"))
    assert options == {"user_credentials": "/run/secrets/relay.creds", "token": "t"}
    assert nats_auth_options(Config(nats_nkey="/s/relay.nk")) == {"nkeys_seed": "/s/relay.nk"}
    # TLS (checked against real servers in tests/integration/test_secured_nats.py).


def test_nats_secrets_are_never_shown(capsys):
    from relay.config import RUN_OPTIONS  # noqa: PLC0415

    token = next(o for o in RUN_OPTIONS if o.name == "nats_token")
    assert token.show("s3cret") == "***"
    urls = next(o for o in RUN_OPTIONS if o.name == "nats_url")
    assert urls.show(("nats://u:pw@a:4222", "tls://b:4222")) == "nats://u:***@a:4222,tls://b:4222"
    assert urls.show(("nats://s3cret-token@a:4222",)) == "nats://***@a:4222"  # a token


def test_every_metric_declared_is_a_typed_attribute_and_exported():
    table = metric_table()
    assert set(table) == set(Metrics.__annotations__)
    metrics = Metrics()
    exported = {m.name for m in metrics.registry.collect()}
    assert {spec["name"] for spec in table.values()} <= exported
    for spec in table.values():
        assert spec["help"]
        assert spec["readme"]


@pytest.mark.parametrize("name", ["odd$$name", "a$b", "schema.x$$"])
def test_a_dollar_in_a_table_or_channel_name_is_refused_before_any_sql(name):
    # The names land inside $$-quoted bodies (sql/install), where "$$" ends the body:
    # `install --table 'odd$$name'` failed with a syntax error.
    with pytest.raises(ValueError, match="not a table name"):
        parse_table_name(name)
    with pytest.raises(ValueError, match="not a channel name"):
        parse_channel(name.replace(".", "_"))
    with pytest.raises(ConfigError, match=r"'\$' in a name"):
        Names.for_config(Config(table=tuple(name.split("."))))
    with pytest.raises(ConfigError):
        Names.for_config(Config(channel=name))
