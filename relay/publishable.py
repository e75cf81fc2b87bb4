"""Whether a row can ever be published: subject grammar, message size, and a time
the envelope can carry.

A row that fails these checks is rejected before it reaches the broker, so it
never burns retries or holds up the rows behind it.
"""

from __future__ import annotations

import functools

from relay.model import FailureReason, Rejection

_WHITESPACE = frozenset(" \t\r\n\f\v")

# The claim query renders a row's time as RFC 3339 text, or null when RFC 3339
# cannot write it (Postgres accepts infinities and years past 9999).
UNWRITABLE_TIME = Rejection(
    FailureReason.INVALID_TIME,
    "time cannot be written in RFC 3339 (infinite, or outside the years 1-9999)",
)


@functools.lru_cache(maxsize=4096)  # event types repeat: check each one once
def subject_problem(subject: str) -> str | None:
    """Why ``subject`` is not a valid NATS publish subject, or None if it is."""
    if not subject:
        return "subject is empty"
    if any(ch in _WHITESPACE or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in subject):
        return "subject contains whitespace or a control character"
    tokens = subject.split(".")
    if any(token == "" for token in tokens):
        return "subject has an empty token (leading, trailing or doubled '.')"
    if any(token in ("*", ">") for token in tokens):
        return "subject contains a wildcard token ('*' or '>'), which cannot be published to"
    if subject.startswith("$"):
        # $JS, $SYS, $KV ... are the server's own API: an event must never land there.
        return "subject starts with '$', which is reserved for the NATS system and APIs"
    return None


def size_problem(message_bytes: int, max_payload: int) -> str | None:
    if message_bytes > max_payload:
        return f"message is {message_bytes} bytes, over the server's max_payload {max_payload}"
    return None
