"""Outages: servers down at start, killed, restarted, and network paths cut or
stalled or dropped. Each test starts its own throwaway server; the shared ones are never
stopped."""

from __future__ import annotations

import signal
import time

import pytest

from relay.sqlfiles import IDLE_LOCK_CLASS
from tests.support import database
from tests.support.database import Event
from tests.support.proxy import proxy_to
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_PG_URL, throwaway_nats, throwaway_postgres
from tests.support.stream import TestStream

pytestmark = pytest.mark.faults


def ids_in(stream: TestStream) -> set[str]:
    return {m.msg_id for m in stream.read()}


def test_nats_down_at_start_then_up(db_url, start_relay):
    with throwaway_nats(started=False) as nats:
        relay = start_relay(nats_url=nats.url, wait_ready=False)
        wait_until(
            lambda: relay.get("/readyz") == (503, "not ready: NATS is not connected\n"),
            message="503 while NATS is down",
        )
        assert relay.get("/healthz")[0] == 200
        events = [Event("outage.start.created", f"s{i}") for i in range(10)]
        database.insert(db_url, events)
        nats.start()
        stream = TestStream(nats.url)
        stream.delete()
        stream.create("OUTAGE", ["outage.>"])
        relay.wait_ready()
        wait_until(lambda: database.unpublished_count(db_url) == 0, message="drain")
        assert {m.msg_id for m in stream.read("OUTAGE")} == {str(e.id) for e in events}
        assert max(r["attempts"] for r in database.rows_by_id(db_url).values()) == 0


def test_nats_killed_and_restarted_loses_nothing(db_url, start_relay):
    with throwaway_nats() as nats:
        stream = TestStream(nats.url)
        relay = start_relay(nats_url=nats.url, backoff_base="100ms", backoff_max="1s")
        before = [Event(stream.subject("k"), f"a{i % 5}") for i in range(100)]
        database.insert(db_url, before)
        wait_until(lambda: database.unpublished_count(db_url) == 0, message="first drain")
        nats.kill()
        wait_until(lambda: relay.get("/readyz")[0] == 503, message="not ready without NATS")
        during = [Event(stream.subject("k"), f"b{i % 5}") for i in range(100)]
        database.insert(db_url, during)
        time.sleep(1.0)
        # No broker, no attempts burned: the rows wait untouched.
        assert database.unpublished_count(db_url) == 100
        rows = database.rows_by_id(db_url)
        assert all(rows[str(e.id)]["attempts"] == 0 for e in during)
        nats.start()
        relay.wait_ready()
        wait_until(lambda: database.unpublished_count(db_url) == 0, timeout=20, message="drain")
        assert ids_in(stream) == {str(e.id) for e in before + during}


def test_nats_killed_mid_stream_backs_off_and_recovers(db_url, start_relay):
    with throwaway_nats() as nats:
        stream = TestStream(nats.url)
        relay = start_relay(
            nats_url=nats.url,
            batch_size=20,
            backoff_base="200ms",
            backoff_max="1s",
            publish_timeout="1s",
        )
        events = [Event(stream.subject("mid"), f"m{i % 9}") for i in range(3000)]
        database.insert(db_url, events[:1500])
        wait_until(lambda: len(stream.read()) > 0, message="first messages")
        nats.kill()
        database.insert(db_url, events[1500:])
        time.sleep(2.0)
        nats.start()
        wait_until(lambda: database.unpublished_count(db_url) == 0, timeout=30, message="drain")
        assert ids_in(stream) == {str(e.id) for e in events}
        # Rows in flight when it died failed at most a few times, each after a backoff:
        # the relay did not spin against the dead broker.
        attempts = [r["attempts"] for r in database.rows_by_id(db_url).values()]
        assert max(attempts) <= 3, max(attempts)
        failures = [
            r for r in relay.log_records() if r.get("message", "").startswith("batch failed")
        ]
        assert len(failures) < 20


def test_postgres_down_at_start_then_up(stream, start_relay):
    with throwaway_postgres(started=False) as pg:
        relay = start_relay(database_url=pg.url, wait_ready=False)
        wait_until(lambda: relay.get("/readyz")[0] == 503, message="503 while Postgres is down")
        _, body = relay.get("/readyz")
        assert "Postgres is unreachable" in body
        pg.start()
        database.install(pg.url)
        relay.wait_ready()
        event = Event(stream.subject("pgup"), "p")
        database.insert(pg.url, [event])
        wait_until(lambda: str(event.id) in ids_in(stream), message="delivery")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restart_loses_nothing(stream, start_relay, mode):
    with throwaway_postgres() as pg:
        database.install(pg.url)
        relay = start_relay(database_url=pg.url, poll_interval="30s")
        first = [Event(stream.subject("r"), f"x{i}") for i in range(50)]
        database.insert(pg.url, first)
        wait_until(lambda: database.unpublished_count(pg.url) == 0, message="first drain")
        pg.restart(mode)
        # The LISTEN connection comes back by itself and sweeps on reconnect.
        wait_until(relay.ready, timeout=30, message="ready again")
        second = [Event(stream.subject("r"), f"y{i}") for i in range(50)]
        database.insert(pg.url, second)
        wait_until(lambda: database.unpublished_count(pg.url) == 0, timeout=20, message="drain")
        assert ids_in(stream) == {str(e.id) for e in first + second}


@pytest.mark.parametrize("mode", ["stall", "drop"])
def test_a_silent_listen_path_is_replaced(db_url, stream, start_relay, mode):
    port = int(SHARED_PG_URL.rsplit(":", 1)[1].split("/")[0])
    with proxy_to(port) as proxy:
        proxied = db_url.replace(f":{port}/", f":{proxy.port}/")
        relay = start_relay(database_url=proxied, poll_interval="30s", listen_keepalive="1s")
        database.insert(db_url, [Event(stream.subject("bh"), "1")])
        wait_until(lambda: len(stream.read()) == 1, message="first delivery")
        proxy.set_mode(mode)
        wait_until(
            lambda: relay.metric("outbox_relay_listen_connected") == 0,
            timeout=10,
            message="dead LISTEN connection detected",
        )
        assert relay.get("/readyz")[0] == 503
        proxy.set_mode("pass")
        wait_until(
            lambda: relay.metric("outbox_relay_listen_connected") == 1,
            timeout=20,
            message="LISTEN reconnected",
        )
        event = Event(stream.subject("bh"), "2")
        database.insert(db_url, [event])
        # Poll is 30 s: only a working LISTEN (or the reconnect sweep) delivers this fast.
        wait_until(lambda: str(event.id) in ids_in(stream), timeout=10, message="delivery")


def test_password_never_appears_in_logs(db_url, start_relay):
    secret = "s3cr3t-pa55word"
    relay = start_relay(
        database_url=f"postgresql://postgres:{secret}@127.0.0.1:1/postgres",
        nats_url=f"nats://user:{secret}@127.0.0.1:1",
        wait_ready=False,
    )
    wait_until(lambda: "retrying" in relay.logs(), message="a logged retry")
    time.sleep(0.5)
    assert relay.stop() == 0
    logs = relay.logs()
    assert "***" in logs
    assert secret not in logs


SLEEP_LOCK_HOLDERS = f"""
select a.pid from pg_locks l join pg_stat_activity a on a.pid = l.pid
 where l.locktype = 'advisory' and l.classid = {IDLE_LOCK_CLASS} and l.mode = 'ExclusiveLock'
   and l.granted and a.application_name = 'outbox-relay listen' and a.datname = current_database()
"""


def test_a_relay_frozen_asleep_stops_making_producers_notify(db_url, stream, start_relay):
    """Asleep, a relay holds the sleep lock and every producer notifies. Frozen
    (SIGSTOP, a paused VM, a cut-off host) it would hold it for as long as its
    session lived: the server ends that session once it has been silent for
    twice the keepalive and a margin (7 s here), and the lock goes with it."""
    relay = start_relay(listen_keepalive="1s", poll_interval="1h")
    wait_until(lambda: relay.metric("outbox_relay_sleeps_total") >= 1, message="asleep")
    [(holder,)] = wait_until(
        lambda: database.fetch(db_url, SLEEP_LOCK_HOLDERS) or None, message="the sleep lock"
    )
    relay.signal(signal.SIGSTOP)
    try:
        wait_until(
            lambda: (
                not database.fetch(
                    db_url, "select 1 from pg_stat_activity where pid = %s", (holder,)
                )
            ),
            timeout=60,
            interval=0.5,
            message="the server ending the frozen relay's LISTEN session",
        )
        assert database.fetch(db_url, SLEEP_LOCK_HOLDERS) == []  # producers stop notifying
    finally:
        relay.signal(signal.SIGCONT)
    # Thawed, it finds its connection gone, listens again and sweeps: a row committed
    # meanwhile, and one after, are delivered with the poll an hour away.
    event = Event(stream.subject("thawed"), "t")
    database.insert(db_url, [event])
    wait_until(lambda: str(event.id) in ids_in(stream), timeout=30, message="delivery")
    wait_until(lambda: database.fetch(db_url, SLEEP_LOCK_HOLDERS), message="asleep again")
