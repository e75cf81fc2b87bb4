"""Whether --database-url goes through a transaction pooler (PgBouncer in transaction
mode, RDS Proxy, Supavisor), which hands each transaction whichever server
connection is free. Behind one, nothing may outlive a transaction: a prepared claim
is gone on the next server connection, and a session setting would stay on a server
connection that other clients (the producers) get next. So the relay then prepares
nothing and sets its settings per transaction.

Until it is known, the relay behaves as behind one (relay/database.py): a session
setting made meanwhile could not be taken back.
"""

from __future__ import annotations

from relay.config import Config


def pooled_from_config(config: Config) -> bool | None:
    """True or False when the configuration settles it; None when only the LISTEN
    self-check on the same URL can tell: a LISTEN connection that does not hear a
    notification sent through another connection of its URL goes through a
    transaction pooler (a session pooler or Postgres delivers it)."""
    if config.database_pooler == "transaction":
        return True
    if config.database_pooler in ("none", "session"):
        return False
    # auto: a separate listen URL is given because the database URL may be pooled;
    # with --poll-only there is no check to tell.
    if config.listen_database_url or config.poll_only:
        return True
    return None
