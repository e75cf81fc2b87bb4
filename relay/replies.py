"""What the broker's answer to one publish means: a PubAck, a JetStream API error,
"no responders", or a permission refusal. Each becomes a
:class:`~relay.model.Failed` that says whose fault it is (relay/model.py), or
:class:`~relay.model.Acked`.
"""

from __future__ import annotations

import json
import re

from nats.aio.msg import Msg

from relay.batchreplies import NO_RESPONDERS, error_failure
from relay.model import Acked, Failed, FailureReason, PublishResult

NO_STREAM = Failed(FailureReason.NO_STREAM, "no stream captures the subject")
PERMISSION_DENIED = Failed(
    FailureReason.PERMISSION_DENIED,
    "NATS denies the relay's user publishing on the subject (its publish permissions)",
)
# The server's -ERR for a publish its permissions deny, as nats-py hands it to the
# error callback; the server drops the message and sends no ack.
_PUBLISH_DENIED = re.compile(r'permissions violation for publish.* to "([^"]+)"', re.IGNORECASE)


def denied_subject(error: str) -> str | None:
    """The subject of a publish-permission violation, or None for any other error."""
    match = _PUBLISH_DENIED.search(error)
    return match.group(1) if match else None


# How long to wait for JetStream to say which stream captures a subject.
NO_STREAM_QUESTION_TIMEOUT = 1.0

# JetStream errors (nats-server's errors.json) that say the stream or the cluster
# cannot store anything right now: storage or account limits reached ("maximum
# messages exceeded" with discard new is a store failure), a stream offline, a
# cluster or raft group without a leader, too many requests in flight.
_BROKER_STATE_ERRORS = frozenset({
    10002,  # resource limits exceeded for account
    10008,  # JetStream system temporarily unavailable
    10009,  # JetStream cluster can not handle request
    10023,  # insufficient resources
    10028,  # insufficient memory resources available
    10041,  # general raft error
    10047,  # insufficient storage resources available
    10077,  # storing a message failed (maximum messages, bytes or per subject; disk)
    10118,  # stream is offline
    10158,  # duplicate message id is in process (another publish of it in flight)
    10167,  # too many requests
    10194,  # stream is offline (with a reason)
})  # fmt: skip


def api_error(code: int | None, err_code: int | None, description: str) -> Failed:
    """The failure a JetStream API error reply stands for: the broker's when it says
    the stream cannot store anything now (a 5xx or 429 status, or one of the codes
    above), otherwise a refusal of this message, counted against the row."""
    detail = f"JetStream refused the message: {description} (err_code {err_code})"
    if (code is not None and (code >= 500 or code == 429)) or err_code in _BROKER_STATE_ERRORS:
        return Failed(FailureReason.STREAM_UNAVAILABLE, detail)
    return Failed(FailureReason.REFUSED, detail)


_PLAIN_ACK = b'{"stream":'
_ACKED = Acked(duplicate=False)


def parse_ack(msg: Msg) -> PublishResult:  # noqa: PLR0911 - one return per kind of reply
    """A JetStream reply: a PubAck, an API error, or "no responders"."""
    if msg.headers and msg.headers.get("Status") == "503":
        return NO_RESPONDERS
    data = msg.data
    if data.startswith(_PLAIN_ACK) and b'"error"' not in data and b'"duplicate"' not in data:
        return _ACKED  # the common case, {"stream":"X", "seq":N}, without a JSON parse
    try:
        reply = json.loads(msg.data)
    except ValueError:
        return Failed(FailureReason.RELAY_ERROR, f"unreadable JetStream reply: {msg.data[:200]!r}")
    if not isinstance(reply, dict):
        return Failed(FailureReason.RELAY_ERROR, f"unexpected JetStream reply: {msg.data[:200]!r}")
    error = reply.get("error")
    if isinstance(error, dict):
        return error_failure(error, api_error)[1]
    if error is not None:
        return Failed(FailureReason.REFUSED, f"JetStream refused the message: {error}")
    if "stream" not in reply:
        return Failed(FailureReason.RELAY_ERROR, f"not a PubAck: {msg.data[:200]!r}")
    return Acked(duplicate=bool(reply.get("duplicate", False)))
