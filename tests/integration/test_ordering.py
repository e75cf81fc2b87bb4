"""Per-subject order under every way of writing a row that Postgres accepts (issue
39): concurrent producers with random pauses before and after their inserts,
explicit old created_at values, writes under session_replication_role = replica,
explicit null relay_seq values, a service trigger that waits before the insert
takes its xid, and rows put back by hand, against a relay process. At the end
every row is published (or dead with a reason inside it) and no subject is out of
order (tests/support/checker.py). On a plain table and on one partitioned by the
minute, whose relays create partitions as the campaign goes on."""

from __future__ import annotations

import pytest

from tests.support import database
from tests.support.campaign import FAST, HOSTILE_KINDS, Campaign, finish

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("outbox_layout", database.LAYOUTS)
def test_every_way_postgres_accepts_a_row_keeps_per_subject_order(
    db_url, stream, start_relay, outbox_layout
):
    relay = start_relay(**FAST)
    campaign = Campaign(
        db_url, stream, producers=8, subjects_per_producer=3, pause=0.01, hostile_rate=1.0
    ).start()
    try:
        campaign.wait_for(600, timeout=180)
    finally:
        campaign.close()
    verdict = finish(campaign, relay, title="hostile writes")
    assert verdict.stored >= verdict.committed
    # Each kind of write was made, and the rows it needed flagged were.
    assert set(campaign.kinds) == set(HOSTILE_KINDS), campaign.kinds
    [(late,)] = database.fetch(db_url, "select count(*) from outbox_events where relay_late")
    assert late > 0
    assert campaign.put_back
    [(kind,)] = database.fetch(
        db_url, "select relkind::text from pg_class where oid = 'outbox_events'::regclass"
    )
    assert kind == {"plain": "r", "partitioned": "p"}[outbox_layout]
    assert "Traceback" not in relay.logs()
    # Every row here is inside the model: the claims found each, and the sweep (the
    # fallback for rows outside it, found a minute later) never had to rewind them.
    assert "sits before where the claims start" not in relay.logs()
