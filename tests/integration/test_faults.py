"""The fault campaign: a real workload, one fault at a time (and then all of them
in one run), checked against the truth in the table and the producers' record.

Every test ends with the checker passing and a relay still serving: nothing lost,
nothing unexpected, nothing marked that is not in the stream, no per-subject
order inversion, and nothing left unpublished short of the attempt cap."""

from __future__ import annotations

import json
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.support import database
from tests.support.campaign import FAST, MAX_ATTEMPTS, Campaign, finish
from tests.support.checker import Committed
from tests.support.database import Event
from tests.support.failover import ThrowawayStandby, failover_url, make_synchronous
from tests.support.proxy import proxy_to
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL, throwaway_nats, throwaway_postgres
from tests.support.stream import TestStream

pytestmark = pytest.mark.faults

# The publish modes, each with a stream that allows it (nats-server 2.15; the
# machine's shared 2.9 server takes neither batch mode).
PUBLISH_MODES = ("message", "batch", "atomic")
STREAM_ALLOWING: dict[str, dict[str, bool]] = {
    "message": {},
    "batch": {"allow_batched": True},
    "atomic": {"allow_atomic": True},
}


def assert_batches_stored(relays: list, mode: str) -> None:
    """In a batch mode, the relays did publish batches (not every row per message)."""
    if mode != "message":
        stored = sum(
            r.metric("outbox_relay_batch_publishes_total", mode=mode, outcome="stored")
            for r in relays
        )
        assert stored > 0, f"no {mode} batch stored"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


@pytest.fixture
def campaign(db_url, stream):
    created = Campaign(db_url, stream)
    yield created
    created.close()


@pytest.mark.parametrize(
    "failpoint", ["crash-before-publish", "crash-after-publish", "crash-after-mark"]
)
def test_kill_9_in_each_crash_window(campaign, start_relay, failpoint):
    campaign.start()
    for _ in range(3):
        campaign.wait_for(len(campaign.committed) + 50)
        doomed = start_relay(wait_ready=False, failpoints=failpoint, **FAST)
        assert doomed.process.wait(30) == -signal.SIGKILL  # it died in the window
    relay = start_relay(**FAST)
    campaign.wait_for(len(campaign.committed) + 200)
    verdict = finish(campaign, relay)
    if failpoint != "crash-before-publish":
        # Published, then killed before the commit: republished with the same
        # Nats-Msg-Id, and the stream's duplicate window dropped the copies.
        assert verdict.duplicates == 0


def test_a_campaign_fails_when_its_drain_stops(campaign, start_relay):
    """The check every campaign ends with can fail: a relay frozen with rows left
    makes no progress, and the drain says so, with what holds it."""
    campaign.start()
    relay = start_relay(**FAST)
    campaign.wait_for(300)
    relay.signal(signal.SIGSTOP)
    campaign.wait_for(len(campaign.committed) + 100)
    campaign.stop()
    try:
        with pytest.raises(AssertionError, match=r"the drain stopped: \d+ of \d+ rows left"):
            campaign.drain(MAX_ATTEMPTS, stall=3)
    finally:
        relay.signal(signal.SIGCONT)
    finish(campaign, relay)


def test_sigterm_in_the_middle_of_batches(campaign, start_relay):
    campaign.start()
    for _ in range(4):
        relay = start_relay(batch_size=20, **FAST)
        campaign.wait_for(len(campaign.committed) + 150)
        assert relay.stop() == 0
    finish(campaign, start_relay(**FAST))


def test_nats_killed_and_restarted(db_url, start_relay):
    with throwaway_nats() as nats:
        stream = TestStream(nats.url)
        campaign = Campaign(db_url, stream).start()
        try:
            relay = start_relay(nats_url=nats.url, **FAST)
            for _ in range(2):
                campaign.wait_for(len(campaign.committed) + 300)
                nats.kill()
                time.sleep(1.0)
                nats.start()
            finish(campaign, relay)
        finally:
            campaign.close()


def test_nats_too_slow_so_acks_time_out(campaign, start_relay):
    with proxy_to(port_of(SHARED_NATS_URL)) as proxy:
        relay = start_relay(
            nats_url=f"nats://127.0.0.1:{proxy.port}", **{**FAST, "publish_timeout": "150ms"}
        )
        campaign.start()
        campaign.wait_for(200)
        proxy.set_mode("latency", latency=0.3)
        time.sleep(3)
        proxy.set_mode("pass")
        wait_until(
            lambda: (
                relay.metric(
                    "outbox_relay_publish_failures_total",
                    event_type=campaign.event_type,
                    reason="timeout",
                )
                > 0
            ),
            message="timed-out publishes",
            timeout=10,
        )
        finish(campaign, relay)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_postgres_restarted_and_crashed(stream, start_relay, mode):
    with throwaway_postgres() as pg:
        database.install(pg.url)
        campaign = Campaign(pg.url, stream).start()
        try:
            relay = start_relay(database_url=pg.url, **FAST)
            for _ in range(2):
                campaign.wait_for(len(campaign.committed) + 300)
                pg.restart(mode)
            relay.wait_ready(timeout=30)
            finish(campaign, relay)
        finally:
            campaign.close()


LISTEN_BACKEND = (
    "select pid from pg_stat_activity "
    "where application_name = 'outbox-relay listen' and datname = current_database()"
)


def test_listen_backend_terminated_again_and_again(db_url, stream, start_relay):
    """With the poll at an hour, only LISTEN (and the sweep on reconnect) wakes the
    relay: every event committed after each termination must arrive within 2 s.
    Traffic is sparse enough that the relay sleeps between events, so a lost
    wake-up would leave rows for the hour-long poll."""
    campaign = Campaign(db_url, stream, pause=0.05).start()
    try:
        relay = start_relay(**{**FAST, "poll_interval": "1h"})
        terminated: set[int] = set()
        for _ in range(5):
            # Wait for this round's LISTEN backend: a termination that lands while the
            # listener is between connections would find none and test nothing.
            [(pid,)] = wait_until(
                lambda: (
                    [r for r in database.fetch(db_url, LISTEN_BACKEND) if r[0] not in terminated]
                    or None
                ),
                message="a new LISTEN backend",
            )
            terminated.add(pid)
            database.execute(db_url, "select pg_terminate_backend(%s)", (pid,))
            campaign.wait_for(len(campaign.committed) + 40)
            due = {event.id for event in campaign.committed}
            wait_until(
                lambda due=due: due <= {m.msg_id for m in stream.read_all()},
                timeout=2.0,
                interval=0.1,
                message="every event committed since the termination",
            )
        finish(campaign, relay)
        assert relay.metric("outbox_relay_wakeups_total", reason="poll") == 0
        assert relay.metric("outbox_relay_sleeps_total") > 0
    finally:
        campaign.close()


# The metric that shows the relay noticed a path that went silent.
NOTICED = {"postgres": "outbox_relay_listen_connected", "nats": "outbox_relay_nats_connected"}


@pytest.mark.parametrize("server", ["postgres", "nats"])
@pytest.mark.parametrize("mode", ["cut", "reset", "stall", "drop", "latency"])
def test_network_to_a_server_cut_reset_stalled_dropped_or_slow(
    db_url, campaign, start_relay, server, mode
):
    target = port_of(SHARED_PG_URL) if server == "postgres" else port_of(SHARED_NATS_URL)
    with proxy_to(target) as proxy:
        settings = dict(FAST, listen_keepalive="1s")
        if server == "postgres":
            settings["database_url"] = db_url.replace(f":{target}/", f":{proxy.port}/")
        else:
            settings["nats_url"] = f"nats://127.0.0.1:{proxy.port}"
        relay = start_relay(**settings)
        campaign.start()
        campaign.wait_for(200)
        proxy.set_mode(mode, latency=0.2)
        if mode in ("stall", "drop"):
            # A path that eats packets says nothing: the fault lasts until the relay
            # has found out by itself (probe, keepalives, tcp_user_timeout, pings).
            wait_until(
                lambda: relay.metric(NOTICED[server]) == 0,
                timeout=40,
                interval=0.2,
                message=f"the relay noticing the {mode} path to {server}",
            )
            if server == "postgres" and mode == "drop":
                # The pooled connections too: a batch on the dead path fails, it
                # does not hang.
                wait_until(
                    lambda: relay.metric("outbox_relay_database_errors_total", task="publisher"),
                    timeout=40,
                    interval=0.2,
                    message="a failed batch on the dropped path",
                )
        else:
            time.sleep(3)
        proxy.set_mode("pass")
        campaign.wait_for(len(campaign.committed) + 200)
        wait_until(relay.ready, timeout=40, message="ready again")
        finish(campaign, relay)


def test_three_relays_one_killed_one_frozen_holding_a_batch(campaign, start_relay):
    settings = dict(FAST, batch_size=50)
    relays = [start_relay(**settings) for _ in range(3)]
    campaign.start()
    campaign.wait_for(300)
    relays[0].kill()
    relays[1].signal(signal.SIGSTOP)  # frozen, most likely in the middle of a batch
    before = len(campaign.stream.read_all())
    campaign.wait_for(len(campaign.committed) + 300)
    wait_until(
        lambda: len(campaign.stream.read_all()) > before + 100,
        timeout=20,
        message="the third relay goes on while one is frozen",
    )
    # The frozen one never comes back; its locks go with its connections.
    relays[1].kill()
    finish(campaign, relays[2])


def _backlog_state(url: str, ids: list[str]) -> str:
    """What a failed wait for ``ids`` to be published should show: their rows, the
    backlog ahead of them, and the relays' sessions and locks."""
    rows = database.fetch(
        url,
        "select id, published_at is not null, attempts, relay_retry_at, relay_last_error "
        "from outbox_events where id = any(%s::uuid[]) order by created_at",
        (ids,),
    )
    ahead = database.fetch(
        url,
        "select count(*), min(created_at), max(attempts) from outbox_events "
        "where published_at is null and created_at < "
        "(select min(created_at) from outbox_events where id = any(%s::uuid[]))",
        (ids,),
    )
    sessions = database.fetch(
        url,
        "select pid, application_name, state, wait_event, left(query, 60), "
        "now() - state_change from pg_stat_activity where datname = current_database()",
    )
    locks = database.fetch(
        url, "select pid, locktype, mode, granted from pg_locks where locktype = 'advisory'"
    )
    return f"rows {rows}\nunpublished ahead {ahead}\nsessions {sessions}\nlocks {locks}"


def late_commit(url: str, campaign: Campaign, before: int = 20, after: int = 20) -> str:
    """The order the relay promises around a transaction that commits late.

    One transaction inserts the first row of a subject (the earliest created_at) and
    stays open while another producer commits ``before`` later rows of the same
    subject; the relay publishes all of them meanwhile, since it cannot see a row
    that has not committed. Then the long transaction commits, and the other
    producer commits ``after`` more rows. Promised: the ``before`` rows in their
    order, then the late row, then the ``after`` rows in their order. The sequence
    numbers say exactly that, so the checker holds the relay to it."""
    subject = f"late-{uuid.uuid4().hex[:8]}"

    def insert(conn: psycopg.Connection, seq: int) -> Committed:
        event = Committed(str(uuid.uuid4()), subject, seq)
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "values (%s, %s, 't', %s, now(), %s, clock_timestamp())",
            (event.id, campaign.event_type, subject, json.dumps({"subject": subject, "seq": seq})),
        )
        return event

    with psycopg.connect(url) as long_tx, psycopg.connect(url, autocommit=True) as other:
        late = insert(long_tx, before + 1)
        early = [insert(other, seq) for seq in range(1, before + 1)]
        for event in early:
            campaign.record(event)
        early_ids = [e.id for e in early]
        try:
            wait_until(  # acked and marked (the checker compares the table with the stream)
                lambda: (
                    database.fetch(
                        url,
                        "select count(*) from outbox_events "
                        "where id = any(%s::uuid[]) and published_at is not null",
                        (early_ids,),
                    )
                    == [(before,)]
                ),
                # Order is what is tested here, not speed: in the mixed campaign six
                # producers can outrun three relays under faults on two cores, and these
                # newest rows then wait behind the backlog.
                timeout=180,
                interval=0.05,
                message="the rows committed while the earlier one was still open",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_backlog_state(url, early_ids)}") from None
        long_tx.commit()
        campaign.record(late)
        for seq in range(before + 2, before + 2 + after):
            campaign.record(insert(other, seq))
    return late.id


def test_a_long_transaction_that_started_first_commits_last(db_url, campaign, start_relay):
    relay = start_relay(**{**FAST, "batch_size": 5})
    campaign.start()
    campaign.wait_for(100)
    late = late_commit(db_url, campaign)
    finish(campaign, relay)
    subject_order = [
        m.envelope["data"]["seq"]
        for m in campaign.stream.read_all()
        if m.envelope["subject"].startswith("late-")
    ]
    assert subject_order == list(range(1, 42))
    assert late in {m.msg_id for m in campaign.stream.read_all()}


def test_poison_rows_in_good_traffic(db_url, stream, start_relay):
    campaign = Campaign(db_url, stream, poison_rate=0.1).start()
    try:
        relay = start_relay(**FAST)
        campaign.wait_for(1500)
        # Rows of an event type no stream captures yet wait, their attempts untouched,
        # and the relay says which subject lacks a stream.
        wait_until(
            lambda: relay.metric("outbox_relay_subjects_without_stream") == 1,
            message="the late event type reported",
        )
        late = database.fetch(
            db_url,
            "select attempts, relay_dead_at is null from outbox_events "
            "where event_type = %s and published_at is null",
            (campaign.late_event_type,),
        )
        assert late
        assert all(attempts == 0 and alive for attempts, alive in late), late
        assert "no stream captures subject" in relay.logs()
        campaign.capture_late_subjects()
        verdict = finish(campaign, relay)
        # Every unpublishable row dead (finish), then skipped by the operator, and never
        # published; every odd but valid one in the stream (the verdict's "lost" would
        # name it), the late ones included; good rows behind dead ones on their subject
        # published after, in order (the verdict's inversions).
        assert verdict.poison > 0
        committed = {e.id: e for e in campaign.committed}
        assert campaign.odd & committed.keys()
        poison = [committed[i] for i in campaign.poison & committed.keys()]
        assert any(
            e.subject == p.subject and e.seq > p.seq and e.id not in campaign.poison
            for p in poison
            for e in committed.values()
        )
        wait_until(
            lambda: relay.metric("outbox_relay_subjects_without_stream") == 0,
            message="the late event type captured",
        )
        reasons = {k for k in relay.metrics() if k.startswith("outbox_relay_dead_marked_total")}
        for reason in ("invalid_subject", "too_large"):
            assert any(f'reason="{reason}"' in k for k in reasons), reasons
        assert not any('reason="no_stream"' in k for k in reasons), reasons
    finally:
        campaign.close()


def publish_failures(relays: list) -> float:
    """Failed publishes, every reason, over ``relays``."""
    return sum(
        value
        for relay in relays
        for key, value in relay.metrics().items()
        if key.startswith("outbox_relay_publish_failures_total")
    )


@pytest.mark.parametrize(
    ("publish_mode", "layout"),
    [*((mode, "plain") for mode in PUBLISH_MODES), ("message", "partitioned")],
)
def test_mixed_campaign_of_every_fault(start_relay, publish_mode, layout):
    """At least 20,000 events through one of every fault kind, then the checker; in
    each publish mode (nats-server 2.15, a stream allowing that mode), and on a table
    partitioned by the minute, whose relays create partitions as the faults go on."""
    with throwaway_postgres() as pg, throwaway_nats() as nats:
        if layout == "partitioned":
            database.install_partitioned(pg.url)
        else:
            database.install(pg.url)
        stream = TestStream(nats.url, **STREAM_ALLOWING[publish_mode])
        campaign = Campaign(
            pg.url, stream, producers=6, poison_rate=0.01, pause=0.001, hostile_rate=0.02
        ).start()
        with proxy_to(pg.port) as pg_proxy, proxy_to(nats.port) as nats_proxy:
            via = {
                "database_url": pg.url.replace(f":{pg.port}/", f":{pg_proxy.port}/"),
                "nats_url": f"nats://127.0.0.1:{nats_proxy.port}",
                **FAST,
                "listen_keepalive": "1s",
                "publish_mode": publish_mode,
                "partitions_ahead": "10min",
            }
            relays = [start_relay(**via) for _ in range(3)]

            def step(events: int = 600) -> None:
                campaign.wait_for(len(campaign.committed) + events, timeout=120)

            faults = []
            for failpoint in ("crash-before-publish", "crash-after-publish", "crash-after-mark"):
                step()
                doomed = start_relay(wait_ready=False, failpoints=failpoint, **via)
                assert doomed.process.wait(30) == -signal.SIGKILL  # it died in the window
                faults.append(failpoint)
            # Until now the late event type had no stream: its rows waited, holding
            # their subjects (and each claim stepped over them, README: known limits).
            campaign.capture_late_subjects()
            faults.append("stream extended late")
            step()
            assert relays[0].stop() == 0
            relays[0] = start_relay(**via)
            faults.append("sigterm")
            step()
            relays[1].kill()
            relays[1] = start_relay(**via)
            faults.append("kill -9")
            step()
            nats.kill()
            time.sleep(1)
            nats.start()
            faults.append("nats restart")
            step()
            nats_proxy.set_mode("latency", latency=0.3)
            time.sleep(2)
            nats_proxy.set_mode("pass")
            faults.append("nats slow")
            step()
            pg.restart("fast")
            faults.append("postgres restart")
            step()
            pg.restart("immediate")
            faults.append("postgres crash")
            step()
            database.execute(
                pg.url,
                "select pg_terminate_backend(pid) from pg_stat_activity "
                "where application_name = 'outbox-relay listen'",
            )
            faults.append("listen terminated")
            for mode in ("stall", "drop", "cut", "reset", "latency"):
                step()
                pg_proxy.set_mode(mode, latency=0.2)
                time.sleep(2)
                pg_proxy.set_mode("pass")
                faults.append(f"postgres path {mode}")
            for mode in ("stall", "drop", "cut", "reset"):
                step()
                # Held until the relays felt it (a publish failed, or a relay lost its
                # connection, which it then does not publish on): 2 s of a stalled path
                # can pass before the client notices anything, and a fault that did
                # nothing is not a fault survived.
                failed_before = publish_failures(relays)
                nats_proxy.set_mode(mode)
                wait_until(
                    lambda before=failed_before: (
                        publish_failures(relays) > before
                        or any(r.metric("outbox_relay_nats_connected") == 0 for r in relays)
                    ),
                    timeout=60,
                    message=f"nats path {mode} to fail a publish or a connection",
                )
                nats_proxy.set_mode("pass")
                faults.append(f"nats path {mode}")
            step()
            relays[2].signal(signal.SIGSTOP)
            step()
            relays[2].kill()
            relays[2] = start_relay(**via)
            faults.append("frozen relay")
            # A reporting session holds the vacuum horizon: every row published or
            # deleted meanwhile stays a dead entry, and the claims start past them
            # (relay/claimstart.py); a transaction commits late inside the hold.
            with psycopg.connect(pg.url, application_name="campaign-report") as reporting:
                reporting.execute("set transaction isolation level repeatable read")
                reporting.execute("select count(*) from outbox_events").fetchall()
                step(3000)
                with ThreadPoolExecutor(1) as pool:
                    late = pool.submit(late_commit, pg.url, campaign)
                    step()
                    late.result(timeout=300)
                [(held,)] = database.fetch(
                    pg.url,
                    "select backend_xmin is not null from pg_stat_activity "
                    "where application_name = 'campaign-report'",
                )
                assert held, "the reporting session held no snapshot"
                reporting.rollback()
            faults.append("horizon held, a late commit inside it")
            campaign.wait_for(20_000, timeout=300)
            assert_batches_stored(relays, publish_mode)
            verdict = finish(
                campaign,
                *relays,
                title=f"mixed campaign, faults: {', '.join(faults)}",
                drain_stall=120,
            )
            assert verdict.poison_dead == verdict.poison > 0
            assert verdict.committed >= 20_000
            campaign.close()


def test_postgres_failover_to_a_synchronous_standby(start_relay):
    """Producers and relays on one libpq URL over a primary and its synchronous
    standby (target_session_attrs=read-write). The primary is killed (-m immediate)
    under load and the standby promoted: every commit that returned reaches the
    stream, in order, and nothing rolled back does. The relays' marks commit with
    synchronous_commit off, so the last ones may be lost with the primary: those
    rows are published again, and the stream's duplicate window absorbs them."""
    with throwaway_postgres() as primary, throwaway_nats() as nats:
        standby = ThrowawayStandby(primary)
        try:
            standby.start()
            make_synchronous(primary, standby)
            url = failover_url(primary, standby)
            database.install(url)
            campaign = Campaign(url, TestStream(nats.url), producers=4).start()
            relays = [start_relay(database_url=url, nats_url=nats.url, **FAST) for _ in range(2)]
            campaign.wait_for(1500)
            primary.stop("immediate")
            standby.promote()
            campaign.wait_for(len(campaign.committed) + 1500, timeout=120)
            verdict = finish(campaign, *relays, title="postgres failover")
            assert verdict.committed >= 3000
            republished = sum(r.metric("outbox_relay_duplicate_acks_total") for r in relays)
            print(f"rows published again after the failover (duplicate acks): {republished:.0f}")
            campaign.close()
        finally:
            standby.destroy()


def test_a_dropped_nats_path_with_a_full_send_buffer_is_noticed(db_url, stream, start_relay):
    """Packets to NATS silently dropped while the relay has more to send than the
    socket takes: nats-py's reconnect first waits for the old transport to close,
    which waits for its buffered data to drain. Without a bound on unacknowledged
    data that is TCP's own retry limit, about 15 minutes without a publish; with
    the relay's (10 s) it is noticed, and publishing resumes once the path is back."""
    with proxy_to(port_of(SHARED_NATS_URL)) as proxy:
        relay = start_relay(nats_url=f"nats://127.0.0.1:{proxy.port}", **FAST)
        big = {"pad": "x" * 60_000}
        events = [Event(stream.subject("big"), f"s{n % 50}", big) for n in range(1_500)]
        database.insert(db_url, events)
        wait_until(
            lambda: relay.metric("outbox_relay_published_total", event_type=stream.subject("big")),
            message="publishing under way",
        )
        proxy.set_mode("drop")
        wait_until(
            lambda: relay.metric("outbox_relay_nats_connected") == 0,
            timeout=45,
            interval=0.2,
            message="the relay noticing the dropped path",
        )
        proxy.set_mode("pass")
        wait_until(
            lambda: database.unpublished_count(db_url) == 0,
            timeout=120,
            message="every row published after the path came back",
        )
    assert sorted(m.msg_id for m in stream.read()) == sorted(str(e.id) for e in events)
