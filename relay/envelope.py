"""Where a message is built: the CloudEvents 1.0 JSON envelope and its headers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from relay.model import OutboxRow

MSG_ID_HEADER = "Nats-Msg-Id"

# One encoder for every message: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Message:
    subject: str
    body: bytes
    headers: dict[str, str]

    @property
    def wire_size(self) -> int:
        """Bytes the server counts against max_payload: headers block plus body."""
        # NATS/1.0\r\n, one "Key: Value\r\n" per header, then a blank line.
        header_bytes = 10 + sum(len(k) + len(v) + 4 for k, v in self.headers.items()) + 2
        return header_bytes + len(self.body)


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def build_message(row: OutboxRow) -> Message:
    """The envelope for ``row``: the row's id is the envelope id and the dedupe key
    (``Nats-Msg-Id``), so a republish inside the stream's duplicate window is dropped
    by the broker and anywhere else by the consumer."""
    head = _ENCODER.encode(
        {
            "specversion": "1.0",
            "id": str(row.id),
            "type": row.event_type,
            "source": row.source,
            "subject": row.subject,
            "time": rfc3339(row.time),
            "datacontenttype": "application/json",
        }
    )
    # ``data`` arrives as jsonb's own text rendering, which is valid JSON: splice it in
    # rather than parse and re-serialise every payload.
    body = f'{head[:-1]},"data":{row.data}}}'.encode()
    return Message(row.event_type, body, {MSG_ID_HEADER: str(row.id)})
