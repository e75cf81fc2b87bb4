"""`outbox-relay bench`: the relay against the floors of Postgres and NATS, and
against the seed's plain poller, in one run."""
