"""The machine's shared servers are never stopped or restarted by a test: their
identity (Postgres's start time, NATS's server id, which is new on every start) is
the same after the tests as before them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import nats
import pytest

from tests.support import database
from tests.support.proxy import remove_leftover_rules
from tests.support.servers import SHARED_NATS_URL, SHARED_PG_URL


def _identity() -> tuple[object, str]:
    [(started,)] = database.fetch(SHARED_PG_URL, "select pg_postmaster_start_time()")

    async def server_id() -> str:
        nc = await nats.connect(SHARED_NATS_URL, connect_timeout=5, allow_reconnect=False)
        try:
            # nats-py keeps the server's INFO privately; a rename fails here, loudly.
            return str(nc._server_info["server_id"])
        finally:
            await nc.close()

    return started, asyncio.run(server_id())


@pytest.fixture(scope="session", autouse=True)
def shared_servers_untouched() -> Iterator[None]:
    remove_leftover_rules()
    before = _identity()
    yield
    assert _identity() == before, "a test stopped or restarted a shared server"
