"""The relay behind PgBouncer (Debian's, 1.18), started by the tests on a free
loopback port in front of Postgres: transaction mode with a direct listen URL,
transaction mode alone, session mode, and the pooler or Postgres killed and
restarted under a running workload."""

from __future__ import annotations

import psycopg
import pytest

from relay_tools.localservers import ThrowawayPgBouncer, throwaway_pgbouncer
from tests.integration.test_faults import FAST, finish, port_of
from tests.support import database
from tests.support.campaign import Campaign
from tests.support.database import Event
from tests.support.relayproc import RelayProcess, wait_until
from tests.support.servers import SHARED_PG_URL, throwaway_postgres
from tests.support.stream import TestStream

pytestmark = pytest.mark.integration

NOT_HEARD = "the LISTEN connection hears no notification sent through another connection"
# Long enough that rows committed one at a time can only arrive in time by LISTEN.
SLOW_POLL = "120s"


def database_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


@pytest.fixture
def transaction_pooler():
    """Two server connections for three relays and the tests' own clients."""
    with throwaway_pgbouncer(port_of(SHARED_PG_URL), pool_size=2) as bouncer:
        yield bouncer


def commit_one_at_a_time(db_url: str, stream: TestStream, count: int) -> list[Event]:
    sent = [
        Event(stream.subject("account.updated"), f"account-{n % 7}", {"n": n}) for n in range(count)
    ]
    database.insert_in_order(db_url, sent, commit_each=True)
    return sent


def assert_each_once_in_order(stream: TestStream, sent: list[Event]) -> None:
    stored = stream.read_all()
    assert sorted(m.msg_id for m in stored) == sorted(str(e.id) for e in sent)
    per_subject: dict[str, list[int]] = {}
    for message in stored:
        envelope = message.envelope
        per_subject.setdefault(envelope["subject"], []).append(envelope["data"]["n"])
    for subject, numbers in per_subject.items():
        assert numbers == sorted(numbers), f"{subject} out of order"


def database_errors(relay) -> float:
    """Every task's database errors (the counter's samples by its task label)."""
    return sum(
        value
        for key, value in relay.metrics().items()
        if key.startswith("outbox_relay_database_errors_total{")
    )


def assert_no_database_error(relay) -> None:
    assert not database_errors(relay), relay.logs()[-3000:]
    assert "prepared statement" not in relay.logs()


def test_a_transaction_pooler_with_a_direct_listen_url(
    db_url, stream, start_relay, transaction_pooler
):
    """Three relays claim through two server connections, switched under them
    between every transaction, and hear notifications on their direct listen URL:
    rows committed one at a time arrive long before the poll would find them."""
    pooled = transaction_pooler.url(database_name(db_url))
    relays = [
        start_relay(
            database_url=pooled,
            listen_database_url=db_url,
            poll_interval=SLOW_POLL,
            batch_size=20,
        )
        for _ in range(3)
    ]
    sent = commit_one_at_a_time(db_url, stream, 600)
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert_each_once_in_order(stream, sent)
    for relay in relays:
        assert_no_database_error(relay)
        assert relay.metric("outbox_relay_poll_only") == 0
        assert relay.get("/readyz") == (200, "ready\n")
    assert sum(r.metric("outbox_relay_wakeups_total", reason="notify") for r in relays) > 0
    # Nothing of the relays' stays on a server connection: no prepared claim, no setting.
    with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as conn:
        for _ in range(4):  # whichever server connection comes
            assert conn.execute("select count(*) from pg_prepared_statements").fetchone() == (0,)
            assert conn.execute("show synchronous_commit").fetchone() == ("on",)


def test_a_transaction_pooler_alone_runs_on_the_poll_and_says_why(
    db_url, stream, start_relay, transaction_pooler
):
    """The only URL is the pooler's: the self-check hears nothing, the relay says
    so in one line, prepares nothing, and publishes everything on its poll."""
    relay = start_relay(
        database_url=transaction_pooler.url(database_name(db_url)), poll_interval="200ms"
    )
    assert relay.get("/readyz") == (
        200,
        "ready (polling only: the LISTEN connection hears no notification)\n",
    )
    assert relay.metric("outbox_relay_poll_only") == 1
    sent = commit_one_at_a_time(db_url, stream, 200)
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert_each_once_in_order(stream, sent)
    assert_no_database_error(relay)
    warnings = [r["message"] for r in relay.log_records() if NOT_HEARD in r["message"]]
    assert len(warnings) == 1, warnings
    assert "--listen-database-url" in warnings[0]
    assert "preparing nothing" in warnings[0]


# The relay's sleep lock (relay/sqlfiles.py, IDLE_LOCK_CLASS), held in this database.
SLEEP_LOCK_HELD = """
select 1 from pg_locks
 where locktype = 'advisory' and classid = 2830 and mode = 'ExclusiveLock' and granted
   and database = (select oid from pg_database where datname = current_database())
"""


def assert_a_notification_wakes(db_url: str, stream: TestStream, relay: RelayProcess) -> None:
    """A row committed while the relay holds its sleep lock notifies, and the
    notification wakes the relay. (Rows committed back to back may all be found by
    claims while it is awake, with no notification at all: so one row at a time,
    each once the lock is held, until one was woken by its notification.)"""
    for n in range(20):
        wait_until(lambda: database.fetch(db_url, SLEEP_LOCK_HELD), message="the sleep lock")
        database.insert(db_url, [Event(stream.subject("account.updated"), "late", {"n": n})])
        wait_until(lambda: database.unpublished_count(db_url) == 0, 30, message="published")
        if relay.metric("outbox_relay_wakeups_total", reason="notify") > 0:
            return
    raise AssertionError("no notification woke the relay in 20 rows")


def test_poll_only_never_listens(db_url, stream, start_relay):
    relay = start_relay(poll_only="true", poll_interval="200ms")
    assert relay.get("/readyz") == (200, "ready (polling only: --poll-only)\n")
    sent = commit_one_at_a_time(db_url, stream, 50)
    wait_until(lambda: database.unpublished_count(db_url) == 0, 60, message="every row published")
    assert_each_once_in_order(stream, sent)
    listening = database.fetch(
        db_url,
        "select count(*) from pg_stat_activity where application_name = 'outbox-relay listen'",
    )
    assert listening == [(0,)]
    assert NOT_HEARD not in relay.logs()


def test_a_session_pooler_works_as_direct(db_url, stream, start_relay):
    # A session pooler gives each client a server connection for as long as it is
    # connected: a relay holds up to six (its pool, LISTEN, the audit, the self-check).
    with throwaway_pgbouncer(port_of(SHARED_PG_URL), pool_mode="session", pool_size=8) as bouncer:
        relay = start_relay(
            database_url=bouncer.url(database_name(db_url)), poll_interval=SLOW_POLL
        )
        sent = commit_one_at_a_time(db_url, stream, 200)
        wait_until(
            lambda: database.unpublished_count(db_url) == 0, 60, message="every row published"
        )
        assert_each_once_in_order(stream, sent)
        assert relay.metric("outbox_relay_poll_only") == 0
        assert_a_notification_wakes(db_url, stream, relay)
        assert_no_database_error(relay)


@pytest.mark.faults
def test_the_pooler_killed_and_postgres_restarted_behind_it(stream, start_relay):
    with throwaway_postgres() as pg:
        database.install(pg.url)
        bouncer = ThrowawayPgBouncer(pg.port, pool_size=2)
        bouncer.start()
        campaign = Campaign(pg.url, stream).start()
        try:
            relays = [
                start_relay(database_url=bouncer.url(), listen_database_url=pg.url, **FAST)
                for _ in range(2)
            ]

            def felt() -> float:
                """Database errors, and LISTEN reconnects (direct to Postgres: a
                restart behind the pooler may cost the pooled connections nothing)."""
                return sum(
                    database_errors(r) + r.metric("outbox_relay_wakeups_total", reason="reconnect")
                    for r in relays
                )

            for fault in ("kill the pooler", "restart Postgres", "kill the pooler"):
                campaign.wait_for(len(campaign.committed) + 300)
                before = felt()
                if fault == "kill the pooler":
                    bouncer.kill()
                    bouncer.start()
                else:
                    pg.restart("fast")
                wait_until(
                    lambda since=before: felt() > since, 30, message=f"the relays felt: {fault}"
                )
            finish(campaign, *relays, title="pooler campaign")
        finally:
            campaign.close()
            bouncer.destroy()
