"""Log lines: readable text by default, one JSON object per line with --log-format json.

Structured fields (row id, event_type, reason) go in ``extra=``; secrets never do.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The pool logs every failed reconnect as a warning; the relay reports outages
    # itself, once per state change.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)


_WARNINGS_KEPT = 1000


class RepeatedWarnings:
    """Logs a warning the first time it is seen, then at most once per ``every``
    seconds with how often it came meanwhile: a refused reconnect every half second
    must not bury the log."""

    def __init__(self, logger: logging.Logger, every: float = 60.0) -> None:
        self._log = logger
        self._every = every
        self._seen: dict[str, tuple[float, int]] = {}  # message: (last logged, since)

    def warn(self, message: str, now: float | None = None, *, key: str | None = None) -> None:
        """``key``: what makes two warnings the same (the message itself by default;
        a kind of warning whose messages name a row each gives one key for them)."""
        now = time.monotonic() if now is None else now
        key = message if key is None else key
        if len(self._seen) > _WARNINGS_KEPT:
            self._seen.clear()  # many distinct messages: each is news anyway
        last, suppressed = self._seen.get(key, (-math.inf, 0))
        if now - last < self._every:
            self._seen[key] = (last, suppressed + 1)
            return
        self._seen[key] = (now, 0)
        if suppressed:
            self._log.warning(
                "%s (%d more times in the last %.0fs)", message, suppressed, now - last
            )
        else:
            self._log.warning("%s", message)
