"""A three-node JetStream cluster and an R3 stream, every node on loopback, under a
campaign of producers: the stream's leader killed and its node restarted with its
storage, a leader stepdown, and the quorum lost for longer than the attempt cap
would last were the failures counted. The checker finds nothing lost, nothing dead,
no order inversion."""

from __future__ import annotations

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
            before = published()
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
            assert_batches_stored(relays, mode)
            verdict = finish(
                campaign, *relays, title="jetstream cluster campaign", drain_timeout=180
            )
            assert verdict.dead == []
        finally:
            campaign.close()
