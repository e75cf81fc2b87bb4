"""Servers for the tests: the machine's shared Postgres and NATS, and throwaway
instances on free loopback ports (relay_tools.localservers) for the tests that kill or
restart them. The shared servers are never stopped or reconfigured; each test
gets its own database and its own stream there."""

from __future__ import annotations

import os

from relay_tools.localservers import (
    ThrowawayNats,
    ThrowawayPostgres,
    ThrowawayStandby,
    free_port,
    throwaway_nats,
    throwaway_postgres,
    wait_for_port,
)

SHARED_PG_URL = os.environ.get(
    "OUTBOX_RELAY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SHARED_NATS_URL = os.environ.get("OUTBOX_RELAY_TEST_NATS", "nats://127.0.0.1:4222")

__all__ = [
    "SHARED_NATS_URL",
    "SHARED_PG_URL",
    "ThrowawayNats",
    "ThrowawayPostgres",
    "ThrowawayStandby",
    "free_port",
    "throwaway_nats",
    "throwaway_postgres",
    "wait_for_port",
]
