"""A Postgres primary with a synchronous streaming standby, both throwaway, for
failover tests: the standby (relay_tools/localservers.py) is a `pg_basebackup` of
the primary that the primary waits for at every commit, and that can be promoted
when the primary dies."""

from __future__ import annotations

import psycopg
from psycopg import sql

from relay_tools.localservers import ThrowawayPostgres, ThrowawayStandby
from tests.support.relayproc import wait_until

__all__ = ["ThrowawayStandby", "failover_url", "make_synchronous"]


def make_synchronous(primary: ThrowawayPostgres, standby: ThrowawayStandby) -> None:
    """Until the primary confirms every commit with the standby before returning it."""
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("alter system set synchronous_standby_names = {}").format(
                sql.Literal(standby.name)
            )
        )
        conn.execute("select pg_reload_conf()")

    def synchronous() -> bool:
        with psycopg.connect(primary.url, autocommit=True) as conn:
            row = conn.execute(
                "select sync_state from pg_stat_replication where application_name = %s",
                (standby.name,),
            ).fetchone()
        return row == ("sync",)

    wait_until(synchronous, timeout=60, message="the standby synchronous")


def failover_url(*servers: ThrowawayPostgres) -> str:
    """One libpq URL over every server that connects to whichever accepts writes."""
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"
