"""What a row may add to its message: the producer's W3C trace context (columns
``traceparent`` and ``tracestate``) and headers of its own (column ``headers``, a
JSON object of strings).

A trace context that W3C Trace Context does not accept is dropped (the caller logs
it): a trace is worth less than the event. Headers are guarded: a ``Nats-`` header
makes the server act (``Nats-Rollup: all`` purges a stream; ``Nats-TTL``,
``Nats-Expected-*``, ``Nats-Msg-Id`` ...), and a name or value NATS cannot carry
breaks the frame. Such a row is the row's fault: dead at once, never published.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import NamedTuple

from relay.jsontext import UnreadableJson, parse_json

# version "00": exactly this; a later version (not "ff") may append fields (W3C
# Trace Context section 3.2.4), which this reader ignores after the first four.
# Neither id may be all zeros. One expression: this runs once per traced row.
_IDS_AND_FLAGS = r"-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}"
_TRACEPARENT = re.compile(rf"00{_IDS_AND_FLAGS}|(?!00|ff)[0-9a-f]{{2}}{_IDS_AND_FLAGS}(-.*)?")
# version-traceid-parentid-flags: 2 + 1 + 32 + 1 + 16 + 1 + 2 characters.
TRACEPARENT_LENGTH = 55
# tracestate: at most 32 list members; this is its longest sane size (W3C: 512
# characters is what a vendor may rely on).
TRACESTATE_LIMIT = 512

# RFC 9110 token characters: what a header name may be made of.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A value travels on one line of the headers block: no CR, LF or other control
# characters (tab is allowed).
_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")
# Set by the relay itself: a row's own would contradict it.
_OWN = frozenset({"traceparent", "tracestate", "status", "description"})
HEADERS_LIMIT = 64  # headers a row may carry


class TraceContext(NamedTuple):
    traceparent: str
    tracestate: str | None


def trace_context(traceparent: str | None, tracestate: str | None) -> TraceContext | None:
    """The producer's trace context, or None when there is none or it is not valid
    W3C Trace Context (a tracestate is kept only with a valid traceparent, and only
    when it is printable ASCII of a sane length)."""
    if traceparent is None:
        return None
    value = traceparent.strip()
    if _TRACEPARENT.fullmatch(value) is None:
        return None
    # A later version's fields after the first four are not read, and not passed on:
    # what goes on the message is hex digits and dashes alone.
    value = value[:TRACEPARENT_LENGTH]
    state = tracestate.strip() if tracestate else None
    # Printable ASCII only (0x20-0x7e): what the header's list members are made of.
    if state and (len(state) > TRACESTATE_LIMIT or not (state.isascii() and state.isprintable())):
        state = None
    return TraceContext(value, state or None)


# Rows repeat their headers (a tenant, a priority): texts up to this long are read
# once and kept, at most HEADERS_CACHED of them, so the cache holds a few MB at most.
HEADERS_CACHED = 4096
HEADERS_CACHED_TEXT = 1024


def row_headers(text: str | None) -> tuple[Mapping[str, str], str | None]:
    """The row's own headers (its ``headers`` column as JSON text), and why they
    cannot be sent when they cannot (then the row goes dead). Shared between rows:
    never changed by a caller."""
    if text is not None and len(text) > HEADERS_CACHED_TEXT:
        return _read_headers(text)
    return _cached_headers(text)


def _read_headers(text: str | None) -> tuple[Mapping[str, str], str | None]:
    try:
        found = None if text is None else parse_json(text)
    except UnreadableJson as exc:
        return {}, f"headers: a JSON object of strings is expected: {exc}"
    if found is None:
        return {}, None
    if not isinstance(found, dict):
        return {}, f"headers: a JSON object of strings is expected, not {type(found).__name__}"
    if len(found) > HEADERS_LIMIT:
        return {}, f"headers: {len(found)} of them, more than {HEADERS_LIMIT}"
    headers: dict[str, str] = {}
    for name, value in found.items():
        problem = header_problem(name, value)
        if problem is not None:
            return {}, f"headers: {problem}"
        # Without surrounding whitespace, as nats-py's publish sends a value: the same
        # bytes in every publish mode.
        headers[name] = value.strip()
    return headers, None


def header_problem(name: str, value: object) -> str | None:
    """Why a header cannot go on an event's message, or None."""
    shown = repr(name[:60])
    if not _TOKEN.fullmatch(name):
        return f"{shown} is not a header name NATS can carry (RFC 9110 token characters)"
    lowered = name.lower()
    if lowered.startswith("nats-"):
        return f"{shown} is reserved: a Nats- header makes the server act on the stream"
    if lowered in _OWN or lowered.startswith("ce-") or lowered == "content-type":
        return f"{shown} is set by the relay (trace context, status, the envelope's own)"
    if not isinstance(value, str):
        return f"{shown}: the value must be a string, not {type(value).__name__}"
    if not _VALUE.fullmatch(value):
        return f"{shown}: the value holds a line break or a control character"
    return None


_cached_headers = functools.lru_cache(maxsize=HEADERS_CACHED)(_read_headers)
