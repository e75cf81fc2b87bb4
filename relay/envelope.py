"""Where a message is built: the CloudEvents 1.0 JSON envelope and its headers."""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import NamedTuple

from relay.model import OutboxRow

MSG_ID_HEADER = "Nats-Msg-Id"

# ``encode_basestring`` is the C routine json.dumps(ensure_ascii=False) uses for a
# string: a quoted, escaped JSON string. The envelope is assembled from it directly,
# which costs a quarter of building a dict and encoding it (this runs once per row).
_quote = encode_basestring


class Message(NamedTuple):
    """One message to publish (a named tuple: one is built per row)."""

    subject: str
    body: bytes
    headers: dict[str, str]

    @property
    def wire_size(self) -> int:
        """Bytes the server counts against max_payload: headers block plus body."""
        # NATS/1.0\r\n, one "Key: Value\r\n" per header, then a blank line. A loop, not
        # sum() over a generator: this runs once per row.
        size = 12 + len(self.body)
        for key, value in self.headers.items():
            size += len(key) + len(value) + 4
        return size


def build_message(row: OutboxRow, time: str) -> Message:
    """The envelope for ``row`` (whose RFC 3339 ``time`` the caller checked): the
    row's id is the envelope id and the dedupe key (``Nats-Msg-Id``), so a republish
    inside the stream's duplicate window is dropped by the broker and anywhere else
    by the consumer."""
    row_id = row.id
    # ``data`` arrives as jsonb's own text rendering, which is valid JSON: splice it in
    # rather than parse and re-serialise every payload.
    body = (
        '{"specversion":"1.0","id":"'
        + row_id
        + '","type":'
        + _quote(row.event_type)
        + ',"source":'
        + _quote(row.source)
        + ',"subject":'
        + _quote(row.subject)
        + ',"time":"'
        + time
        + '","datacontenttype":"application/json","data":'
        + row.data
        + "}"
    )
    return Message(row.event_type, body.encode(), {MSG_ID_HEADER: row_id})
