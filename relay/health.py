"""What /healthz and /readyz answer, decided from the relay's state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Health:
    """Set by the tasks that own each connection; read by the HTTP server."""

    database: bool = False
    listening: bool = False
    broker: bool = False
    # False from a batch the broker acknowledged none of, until one it acknowledges;
    # broker_problem says how it failed.
    broker_acking: bool = True
    broker_problem: str = ""
    setup_problem: str | None = None
    stopping: bool = False
    # Why the relay runs on its poll alone, without LISTEN ("" while it listens).
    poll_only: str = ""

    def not_ready_reason(self) -> str | None:
        """None when the relay can do its work; otherwise a one-line reason (the first
        that holds, in this order)."""
        reasons = (
            (self.stopping, "shutting down"),
            (bool(self.setup_problem), self.setup_problem or ""),
            (not self.database, "Postgres is unreachable"),
            (not self.listening and not self.poll_only, "LISTEN connection is down"),
            (not self.broker, "NATS is not connected"),
            (
                not self.broker_acking,
                f"NATS acknowledges no publish ({self.broker_problem or 'no ack'}): "
                "the rows wait, their attempts untouched",
            ),
        )
        return next((reason for holds, reason in reasons if holds), None)

    def ready_detail(self) -> str:
        """What /readyz says beside "ready": how new rows are found, if not by LISTEN."""
        return f" (polling only: {self.poll_only})" if self.poll_only else ""
