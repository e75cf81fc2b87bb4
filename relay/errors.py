"""One error tree for the relay.

Each leaf tells the caller what to do about it: fix the configuration and
restart, retry later, or give up on one row. Library exceptions are
translated into these once, at the adapter edge, with the original kept as
``__cause__``.
"""

from __future__ import annotations


class RelayError(Exception):
    """Root of every error the relay raises on purpose."""


class ConfigError(RelayError):
    """A setting is wrong. Fix it and start again; retrying cannot help."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


class SetupError(RelayError):
    """The database is reachable but not prepared (no table, relay SQL missing)."""


class TransientError(RelayError):
    """A server is unreachable or misbehaving. Retry later, with backoff."""


class DatabaseUnavailable(TransientError):
    """Postgres could not be reached, or the connection broke mid-work."""


class BrokerUnavailable(TransientError):
    """NATS could not be reached, or the connection broke mid-work."""


class UnexpectedError(TransientError):
    """Something the relay did not expect failed its work (a bug of its own or of a
    library), logged with its traceback where it was met. The work is retried later:
    the relay keeps serving, and a row never pays for it."""


def first_line(exc: BaseException) -> str:
    """An exception as one log line: its message's first line, or its class's name
    when it has no message (a server's error can run to a dozen lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__
