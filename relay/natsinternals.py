"""The only code that touches nats-py's private parts: its write queue and its
transport. pyproject.toml pins nats-py to the releases tested with it; an upgrade has
this one module to check, and :func:`check` to fail on at start.

Why reach in at all. nats-py queues every PUB and leaves the write to its flusher
task, whose turn under trio-asyncio comes a good part of a light-load
commit-to-broker time later (docs/performance.md); and a batch's frames, queued one
by one through nats-py's publish, cost a fast batch more than the rest of its
sending. Frames queued here bypass nats-py's max_pending_size back-pressure: they are
at most one claimed batch (--batch-size rows, each under max_payload), whose rows
the relay holds in memory anyway, and they go to the socket at once.
"""

from __future__ import annotations

from nats.aio.client import Client

from relay.errors import SetupError


def check(nc: Client) -> None:
    """Fail, in one line, when this nats-py lacks what the relay writes through (a
    release that renamed its write queue): without it every batch would fail as
    "disconnected", an endless broker outage instead of a crash."""
    pending = getattr(nc, "_pending", None)
    size = getattr(nc, "_pending_data_size", None)
    if not isinstance(pending, list) or not isinstance(size, int) or not hasattr(nc, "_transport"):
        raise SetupError(
            "this nats-py has no _pending write queue, _pending_data_size or _transport: "
            "install a release pyproject.toml allows (the relay writes through them)"
        )


def send_queued(nc: Client) -> None:
    """Hand the messages nats-py has queued to the socket now, in this task. Does what
    the flusher would, short of waiting for the socket to drain; the flusher then
    finds nothing to write."""
    pending = nc._pending
    transport = nc._transport
    if not pending or transport is None or not nc.is_connected:
        return
    transport.writelines(pending)
    nc._pending = []
    nc._pending_data_size = 0


def queue_frames(nc: Client, frames: list[bytes]) -> bool:
    """Queue protocol frames on nats-py's write queue, for :func:`send_queued`;
    False (nothing queued) when not connected."""
    if not nc.is_connected:
        return False
    nc._pending.extend(frames)
    nc._pending_data_size += sum(map(len, frames))
    return True
