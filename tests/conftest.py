from __future__ import annotations

# Before anything imports psycopg or nats (see relay/__init__.py): tests that run
# the relay's parts in this process need it, as the relay does.
import trio_asyncio  # noqa: F401  # isort: skip

from collections.abc import Iterator

import pytest

from tests.support import database
from tests.support.relayproc import RelayProcess
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL
from tests.support.stream import TestStream


@pytest.fixture
def outbox_layout() -> str:
    """How db_url's outbox table is laid out: plain, unless a test parametrizes this
    with ``database.LAYOUTS`` (or a module overrides it) to run on both."""
    return "plain"


@pytest.fixture
def db_url(outbox_layout: str) -> Iterator[str]:
    """A fresh database on the machine's Postgres, with the relay installed on a
    plain outbox table or one partitioned by the minute (``outbox_layout``)."""
    url = database.create_database(SHARED_PG_URL)
    if outbox_layout == "partitioned":
        database.install_partitioned(url)
    else:
        database.install(url)
    yield url
    database.drop_database(SHARED_PG_URL, url)


@pytest.fixture
def stream() -> Iterator[TestStream]:
    created = TestStream(SHARED_NATS_URL)
    yield created
    created.delete()


@pytest.fixture
def relays() -> Iterator[list[RelayProcess]]:
    """Relays started by a test; killed and cleaned up afterwards whatever happened."""
    started: list[RelayProcess] = []
    yield started
    for relay in started:
        relay.close()


@pytest.fixture
def start_relay(relays: list[RelayProcess], db_url: str, outbox_layout: str):
    # On a partitioned table the relays keep the partitions as far ahead as
    # install_partitioned made them, not the default 3 days of minutes.
    layout_settings = {"partitions_ahead": "10min"} if outbox_layout == "partitioned" else {}

    def start(
        database_url: str | None = None,
        nats_url: str = SHARED_NATS_URL,
        wait_ready: bool = True,
        environment: dict[str, str] | None = None,
        **settings: object,
    ) -> RelayProcess:
        settings = {**layout_settings, **settings}
        relay = RelayProcess(database_url or db_url, nats_url, environment, **settings)
        relays.append(relay)
        return relay.start(wait_ready=wait_ready)

    return start
