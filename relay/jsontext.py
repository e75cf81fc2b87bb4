"""JSON text as Postgres renders a jsonb value (a row's ``data`` and ``headers``),
parsed into Python values, for the checks that must look inside it.

jsonb accepts what a double cannot hold (``1e400`` is rendered as its 401 digits)
and nesting far deeper than 1,024 levels. orjson, fast, refuses both; Python's
json reads such numbers exactly, as ints; what neither can read is a reason inside
the row, said in a line (:class:`UnreadableJson`), never an exception of a parser.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


class UnreadableJson(ValueError):
    """The text is JSON that cannot be read into Python values; the message says why."""


def parse_json(text: str) -> Any:
    """``text``'s value; raises :class:`UnreadableJson`."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass  # a number beyond a double, or nesting deeper than orjson reads
    try:
        return json.loads(text)
    except RecursionError:
        raise UnreadableJson("nested deeper than the relay reads") from None
    except ValueError as exc:  # an integer longer than Python converts
        raise UnreadableJson(f"cannot be read: {str(exc)[:120]}") from None
