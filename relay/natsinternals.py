"""The only code that touches nats-py's private parts: its write queue and its
transport. pyproject.toml pins nats-py to the releases tested with it; an upgrade has
this one module to check, and :func:`check` to fail on at start.

Why reach in at all. nats-py queues every PUB and leaves the write to its flusher
task, whose turn under trio-asyncio comes a good part of a light-load
commit-to-broker time later (docs/performance.md); and messages queued one by one
through nats-py's publish (which checks and encodes each header apart) cost a wave
or a batch more than the rest of its sending. Frames queued here bypass nats-py's
max_pending_size back-pressure: they are at most one claimed batch (--batch-size
rows, each under max_payload), whose rows the relay holds in memory anyway, and they
go to the socket at once.
"""

from __future__ import annotations

import socket

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


# How long data may go unacknowledged on the NATS socket before the kernel gives the
# connection up: as tcp_user_timeout on the database connections.
TCP_USER_TIMEOUT_MS = 10_000


def bound_unacknowledged_data(nc: Client) -> bool:
    """Make the kernel give up the connection once data has gone unacknowledged for
    TCP_USER_TIMEOUT_MS. Without it, a path that silently drops packets while the
    socket's send buffer is full keeps nats-py's reconnect waiting for the old
    transport to close (its buffered data never drains) for as long as TCP retries,
    about 15 minutes, and nothing is published meanwhile. False when this nats-py's
    transport does not show its socket (then the kernel's default stands)."""
    writer = getattr(nc._transport, "_io_writer", None)
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is None or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
    return True
