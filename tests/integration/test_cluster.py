"""A three-node JetStream cluster and an R3 stream, every node on loopback, under a
campaign of producers: the stream's leader killed and its node restarted with its
storage, a leader stepdown, and the quorum lost for longer than the attempt cap
would last were the failures counted. The checker finds nothing lost, nothing dead,
no order inversion.

A replicated stream can acknowledge a fast batch it has not stored (the last test
shows it): the relay publishes into one per message even when the stream allows
fast batches and the relay is told to use them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

import nats
import pytest

from tests.integration.test_faults import (
    FAST,
    MAX_ATTEMPTS,
    PUBLISH_MODES,
    STREAM_ALLOWING,
    assert_batches_stored,
    finish,
)
from tests.support import database
from tests.support.campaign import Campaign
from tests.support.cluster import throwaway_cluster
from tests.support.relayproc import wait_until

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("mode", PUBLISH_MODES)
def test_leader_lost_stepped_down_and_quorum_lost_kill_and_reorder_nothing(
    db_url, start_relay, mode
):
    with throwaway_cluster() as cluster:
        stream = cluster.r3_stream(**STREAM_ALLOWING[mode])
        # About 200 events/s over 100 subjects.
        campaign = Campaign(db_url, stream, producers=4, subjects_per_producer=25, pause=0.04)
        campaign.start()
        try:
            relays = [
                start_relay(nats_url=cluster.url, publish_mode=mode, **FAST) for _ in range(2)
            ]

            def step(events: int = 300) -> None:
                campaign.wait_for(len(campaign.committed) + events, timeout=120)

            def published() -> int:
                """Messages in the stream; -1 while the cluster cannot say (recovering)."""
                try:
                    return len(stream.read_all())
                except Exception:  # noqa: BLE001 - asked again until it answers
                    return -1

            step()
            # The leader killed; a new one is elected; the node comes back with its store.
            leader = cluster.wait_for_leader(stream.name)
            leader.kill()
            step()
            cluster.start(leader)
            step()
            # A stepdown: the leader hands over on purpose.
            cluster.step_down(stream.name)
            step()
            # The quorum lost: two of three nodes down. The relay stays connected to the
            # survivor, which cannot store anything. It waits until the relays have
            # each met the outage several times, longer than the attempt cap (8, with
            # retries every 50-500 ms: about 2.3 s) would last were failures counted.
            cluster.wait_for_leader(stream.name)
            down = [node for node in cluster.nodes if node.name != cluster.nodes[0].name]
            # A count the stream gave: with -1 ("cannot say") the wait for publishing
            # again below would be true at once.
            [before] = wait_until(
                lambda: (n := published()) >= 0 and [n], message="the stream answering"
            )
            outages = [relay.metric("outbox_relay_broker_outage_batches_total") for relay in relays]
            for node in down:
                node.kill()

            def waiting_out_the_outage(relay, outages_before: float) -> bool:
                # Reconnected to the survivor, finding that it stores nothing, again and
                # again, and saying so.
                return (
                    relay.metric("outbox_relay_broker_outage_batches_total") >= outages_before + 4
                    and "NATS acknowledges no publish" in relay.get("/readyz")[1]
                )

            wait_until(
                lambda: all(map(waiting_out_the_outage, relays, outages)),
                timeout=120,
                message="each relay waiting out the lost quorum",
            )
            assert database.dead_count(db_url, MAX_ATTEMPTS) == 0
            for node in down:
                cluster.start(node)
            wait_until(lambda: published() > before, timeout=120, message="publishing again")
            step()
            if mode == "batch":
                assert_no_fast_batch(relays, stream.name)
            else:
                assert_batches_stored(relays, mode)
            verdict = finish(campaign, *relays, title="jetstream cluster campaign", drain_stall=180)
            assert verdict.dead == []
        finally:
            campaign.close()


def assert_no_fast_batch(relays: list, stream: str) -> None:
    """The relays published into the replicated stream per message, and said why."""
    for relay in relays:
        assert relay.metric("outbox_relay_publish_mode", stream=stream, mode="message") == 1
        sent = [
            value
            for key, value in relay.metrics().items()
            if key.startswith("outbox_relay_batch_publishes_total{") and 'mode="batch"' in key
        ]
        assert sum(sent) == 0, f"fast batches sent into a replicated stream: {sent}"
        assert f"stream {stream} allows fast batches but has 3 replicas" in relay.logs()


def test_a_replicated_stream_acks_a_fast_batch_it_has_not_stored():
    """Why the relay sends no fast batch into a replicated stream (nats-server 2.15.1):
    a leader that has lost its quorum proposes a batch it cannot commit; the same
    messages sent again in a new fast batch find their ids "in process", are
    skipped as duplicates, and the batch is acknowledged in full. The leader then
    goes, and the new one never had them. (A single publish of such a message gets
    error 10158 instead, and is tried again.) Should this test fail on a newer
    server, the rule in relay/streams.py can gain a version bound."""
    with throwaway_cluster() as cluster:
        stream = cluster.r3_stream(allow_batched=True)
        leader = cluster.wait_for_leader(stream.name)
        followers = [node for node in cluster.nodes if node is not leader]
        for node in followers:
            node.kill()
        ids = [f"m{uuid.uuid4().hex[:8]}-{seq}" for seq in range(1, 11)]
        first, second = asyncio.run(two_fast_batches(leader.url, stream.subject("x"), ids))
        assert not [reply for reply in first if b'"count"' in reply], first
        final = json.loads(second[-1])
        assert final["count"] == len(ids), second  # "stored", says the leader
        leader.kill()  # the only node that holds the proposals
        cluster.start(followers[0])
        cluster.start(followers[1])
        cluster.wait_for_leader(stream.name)
        cluster.start(leader)
        cluster.wait_for_leader(stream.name)
        assert [m.msg_id for m in stream.read_all()] == []


async def two_fast_batches(url: str, subject: str, ids: list[str]) -> list[list[bytes]]:
    """The replies to a fast batch of ``ids`` and to the same batch sent again."""
    nc = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        return [await fast_batch(nc, subject, ids) for _ in range(2)]
    finally:
        await nc.close()


async def fast_batch(nc: nats.NATS, subject: str, ids: list[str]) -> list[bytes]:
    """A ``gap: fail`` fast batch (ADR-50 reply subjects); its replies, once the
    final PubAck has come or two seconds have passed."""
    prefix, batch, replies = nc.new_inbox() + ".", uuid.uuid4().hex, []
    answered, done = asyncio.Event(), asyncio.Event()

    async def on_reply(msg) -> None:
        replies.append(msg.data)
        answered.set()
        if b'"count"' in msg.data or b'"error"' in msg.data:
            done.set()

    sub = await nc.subscribe(prefix + ">", cb=on_reply)
    for seq, msg_id in enumerate(ids, 1):
        op = 0 if seq == 1 else 2 if seq == len(ids) else 1
        reply = f"{prefix}{batch}.500.fail.{seq}.{op}.$FI"
        await nc.publish(subject, b"{}", reply=reply, headers={"Nats-Msg-Id": msg_id})
        if seq == 1:  # the first message alone, as the relay sends it: its reply opens the batch
            await nc.flush()
            await asyncio.wait_for(answered.wait(), 5)
    await nc.flush()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), 2)
    await sub.unsubscribe()
    return replies
