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

    def not_ready_reason(self) -> str | None:
        """None when the relay can do its work; otherwise a one-line reason (the first
        that holds, in this order)."""
        reasons = (
            (self.stopping, "shutting down"),
            (bool(self.setup_problem), self.setup_problem or ""),
            (not self.database, "Postgres is unreachable"),
            (not self.listening, "LISTEN connection is down"),
            (not self.broker, "NATS is not connected"),
            (
                not self.broker_acking,
                f"NATS acknowledges no publish ({self.broker_problem or 'no ack'}): "
                "the rows wait, their attempts untouched",
            ),
        )
        return next((reason for holds, reason in reasons if holds), None)
