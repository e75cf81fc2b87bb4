"""What /healthz and /readyz answer, decided from the relay's state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Health:
    """Set by the tasks that own each connection; read by the HTTP server."""

    database: bool = False
    listening: bool = False
    broker: bool = False
    setup_problem: str | None = None
    stopping: bool = False

    def not_ready_reason(self) -> str | None:
        """None when the relay can do its work; otherwise a one-line reason."""
        if self.stopping:
            return "shutting down"
        if self.setup_problem:
            return self.setup_problem
        if not self.database:
            return "Postgres is unreachable"
        if not self.listening:
            return "LISTEN connection is down"
        if not self.broker:
            return "NATS is not connected"
        return None
