"""The fault campaign: a real workload, one fault at a time (and then all of them
in one run), checked against the truth in the table and the producers' record.

Every test ends with the checker passing and a relay still serving: nothing lost,
nothing unexpected, nothing marked that is not in the stream, no per-subject
order inversion, and nothing left unpublished short of the attempt cap."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable

import psycopg
import pytest

from tests.support import database
from tests.support.campaign import Campaign
from tests.support.checker import Committed
from tests.support.proxy import proxy_to
from tests.support.relayproc import RelayProcess, wait_until
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL, throwaway_nats, throwaway_postgres
from tests.support.stream import TestStream

pytestmark = pytest.mark.faults

MAX_ATTEMPTS = 8
# Fast retries, so a campaign drains in seconds after its faults.
FAST = {
    "backoff_base": "50ms",
    "backoff_max": "500ms",
    "max_attempts": MAX_ATTEMPTS,
    "publish_timeout": "1s",
    "poll_interval": "200ms",
}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])


def finish(campaign: Campaign, relay: RelayProcess | None = None) -> None:
    """Stop the producers, drain, check, and show the counts."""
    campaign.stop()
    campaign.drain(MAX_ATTEMPTS)
    verdict = campaign.verdict(MAX_ATTEMPTS)
    print("\n" + verdict.summary())
    assert verdict.ok, (
        verdict.summary() + f"\nlost {verdict.lost[:5]} inversions "
        f"{verdict.order_inversions[:5]} stuck {verdict.stuck[:5]}"
    )
    assert verdict.committed > 0
    if relay is not None:
        assert relay.process.poll() is None, "the relay should still be serving"
        assert relay.ready()


@pytest.fixture
def campaign(db_url, stream):
    created = Campaign(db_url, stream)
    yield created
    created.stop()


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
    finish(campaign, relay)
    verdict = campaign.verdict(MAX_ATTEMPTS)
    if failpoint != "crash-before-publish":
        # Published, then killed before the commit: republished with the same
        # Nats-Msg-Id, and the stream's duplicate window dropped the copies.
        assert verdict.duplicates == 0


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
            campaign.stop()


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
            campaign.stop()


def test_listen_backend_terminated_again_and_again(db_url, campaign, start_relay):
    relay = start_relay(**{**FAST, "poll_interval": "30s"})
    campaign.start()
    for _ in range(5):
        campaign.wait_for(len(campaign.committed) + 100)
        database.execute(
            db_url,
            "select pg_terminate_backend(pid) from pg_stat_activity "
            "where application_name = 'outbox-relay listen' "
            "and datname = current_database()",
        )
    finish(campaign, relay)
    assert relay.metric("outbox_relay_wakeups_total", reason="reconnect") >= 5


@pytest.mark.parametrize("server", ["postgres", "nats"])
@pytest.mark.parametrize("mode", ["cut", "reset", "blackhole", "latency"])
def test_network_to_a_server_cut_reset_blackholed_or_slow(
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


def late_commit(url: str, campaign: Campaign, while_open: Callable[[], object]) -> str:
    """Insert an event, keep the transaction open through ``while_open`` (other rows
    commit and publish meanwhile), then commit: its created_at is older than theirs."""
    event_id = str(uuid.uuid4())
    with psycopg.connect(url) as conn:
        conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at) "
            "values (%s, %s, 't', 'late-subject', now(), %s, clock_timestamp())",
            (event_id, campaign.event_type, json.dumps({"subject": "late-subject", "seq": 1})),
        )
        while_open()
        conn.commit()
    campaign.committed.append(Committed(event_id, "late-subject", 1))
    return event_id


def test_a_long_transaction_that_started_first_commits_last(db_url, campaign, start_relay):
    relay = start_relay(**FAST)
    campaign.start()
    late = late_commit(db_url, campaign, lambda: campaign.wait_for(500))
    finish(campaign, relay)
    assert late in {m.msg_id for m in campaign.stream.read_all()}


def test_poison_rows_in_good_traffic(db_url, stream, start_relay):
    campaign = Campaign(db_url, stream, poison_rate=0.1).start()
    try:
        relay = start_relay(**FAST)
        campaign.wait_for(1500)
        finish(campaign, relay)
        verdict = campaign.verdict(MAX_ATTEMPTS)
        assert verdict.dead > 0  # the unpublishable ones, at the cap, not lost
        reasons = {k for k in relay.metrics() if k.startswith("outbox_relay_dead_marked_total")}
        for reason in ("invalid_subject", "too_large", "no_stream"):
            assert any(f'reason="{reason}"' in k for k in reasons), reasons
    finally:
        campaign.stop()


def test_mixed_campaign_of_every_fault(start_relay):
    """At least 20,000 events through one of every fault kind, then the checker."""
    with throwaway_postgres() as pg, throwaway_nats() as nats:
        database.install(pg.url)
        stream = TestStream(nats.url)
        campaign = Campaign(pg.url, stream, producers=6, poison_rate=0.01, pause=0.001).start()
        with proxy_to(pg.port) as pg_proxy, proxy_to(nats.port) as nats_proxy:
            via = {
                "database_url": pg.url.replace(f":{pg.port}/", f":{pg_proxy.port}/"),
                "nats_url": f"nats://127.0.0.1:{nats_proxy.port}",
                **FAST,
                "listen_keepalive": "1s",
            }
            relays = [start_relay(**via) for _ in range(3)]

            def step(events: int = 600) -> None:
                campaign.wait_for(len(campaign.committed) + events, timeout=120)

            faults = []
            for failpoint in ("crash-before-publish", "crash-after-publish", "crash-after-mark"):
                step()
                doomed = start_relay(wait_ready=False, failpoints=failpoint, **via)
                doomed.process.wait(30)
                faults.append(failpoint)
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
            for mode in ("blackhole", "cut", "reset", "latency"):
                step()
                pg_proxy.set_mode(mode, latency=0.2)
                time.sleep(2)
                pg_proxy.set_mode("pass")
                faults.append(f"postgres path {mode}")
            for mode in ("blackhole", "cut", "reset"):
                step()
                nats_proxy.set_mode(mode)
                time.sleep(2)
                nats_proxy.set_mode("pass")
                faults.append(f"nats path {mode}")
            step()
            relays[2].signal(signal.SIGSTOP)
            step()
            relays[2].kill()
            relays[2] = start_relay(**via)
            faults.append("frozen relay")
            late = threading.Thread(
                target=late_commit, args=(pg.url, campaign, lambda: time.sleep(2))
            )
            late.start()
            step()
            late.join()
            faults.append("late commit")
            campaign.wait_for(20_000, timeout=300)
            campaign.stop()
            for relay in relays:
                wait_until(relay.ready, timeout=60, message="every relay ready again")
            campaign.drain(MAX_ATTEMPTS, timeout=120)
            verdict = campaign.verdict(MAX_ATTEMPTS)
            print(f"\nmixed campaign, faults: {', '.join(faults)}\n{verdict.summary()}")
            assert verdict.ok, verdict.summary()
            assert verdict.committed >= 20_000
