"""How many relays share the table. Each relay holds a shared advisory lock (the
presence lock, ``presence_lock`` in sql/queries.sql) on its LISTEN connection for as
long as that session lasts, and the gauges task counts the holders on each read. The
scheduler judges the table's rate by its own share of the rows times this count
(:class:`relay.scheduler.ClaimRate`): three relays at 1,000 events/s each claim
about 333 a second, which alone would read as light load."""

from __future__ import annotations


class Replicas:
    """The count of relays sharing the table, as last read: at least this one (a
    relay whose LISTEN connection is down holds no presence lock, and still counts)."""

    def __init__(self) -> None:
        self.count = 1

    def saw(self, holders: int) -> None:
        self.count = max(1, holders)
