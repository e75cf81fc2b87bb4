"""A small TCP proxy the tests own, for network faults (Toxiproxy cannot be
installed here). Modes:

- ``pass``: forward bytes both ways;
- ``latency``: forward, each chunk delayed by ``latency`` seconds;
- ``stall``: keep every connection open but forward nothing, and accept new
  connections without forwarding either. The kernel still acknowledges every
  packet, so this is a peer that stopped reading, not a broken path;
- ``drop``: every packet to or from the proxy's port is discarded by an nftables
  rule (a path that silently eats packets: no ACK, no RST), so TCP retransmits,
  and ``tcp_user_timeout``, keepalives and application pings are what notice;
- ``reset``: close every connection with RST, and keep resetting new ones;
- ``cut``: close every connection and refuse new ones (nothing listens).

The nftables rules live in a table of their own named after the proxy's port
(``inet outbox_relay_test_<port>``) and match only that loopback port; leaving
``drop`` or closing the proxy deletes the table.
"""

from __future__ import annotations

import contextlib
import select
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator

from tests.support.servers import free_port


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.mode = "pass"
        self.latency = 0.0
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket | None]] = []
        self._stopped = threading.Event()
        # Set (and replaced) on every mode change: what a stalled pump waits on.
        self._changed = threading.Event()
        self._listener: socket.socket | None = None
        self._listen()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        # The listener "cut" closed may still be held by the accept loop's call in
        # flight (up to its 0.1 s timeout): until that returns, the port is taken.
        deadline = time.monotonic() + 5.0
        while True:
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", self.port))
            except OSError:
                listener.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            break
        listener.listen(128)
        listener.settimeout(0.1)
        self._listener = listener

    def set_mode(self, mode: str, latency: float = 0.0) -> None:
        assert mode in MODES, mode
        with self._lock:
            if mode == "drop" and self.mode != "drop":
                drop_packets(self.port)
            elif mode != "drop" and self.mode == "drop":
                stop_dropping(self.port)
            self.mode, self.latency = mode, latency
            self._changed.set()
            self._changed = threading.Event()
            if mode in ("reset", "cut"):
                for client, upstream in self._pairs:
                    _reset(client)
                    if upstream is not None:
                        _reset(upstream)
                self._pairs.clear()
            if mode == "cut" and self._listener is not None:
                with contextlib.suppress(OSError):  # wakes the accept loop's call
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
                self._listener = None
            elif mode != "cut" and self._listener is None:
                self._listen()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            listener = self._listener
            if listener is None:
                time.sleep(0.05)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError, ValueError):
                continue
            with self._lock:
                mode = self.mode
            if mode == "reset":
                _reset(client)
                continue
            if mode == "stall":
                with self._lock:
                    self._pairs.append((client, None))
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        try:
            while not self._stopped.is_set():
                with self._lock:
                    mode, changed = self.mode, self._changed
                if mode == "stall":
                    # Hold the bytes: nothing is read, so nothing reaches the other side.
                    changed.wait(0.5)
                    continue
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                with self._lock:
                    mode, latency = self.mode, self.latency
                if mode == "stall":
                    continue
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if mode == "latency" and latency:
                        time.sleep(latency)
                    peers[sock].sendall(data)
        except (OSError, ValueError):  # ValueError: a socket closed under select()
            return
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        self._stopped.set()
        self.set_mode("cut")
        self._thread.join(2)


MODES = ("pass", "latency", "stall", "drop", "reset", "cut")
NFT_TABLE_PREFIX = "outbox_relay_test_"


def _nft(*commands: str) -> None:
    nft = shutil.which("nft")
    assert nft, "nft is missing: tests/ensure-environment.sh installs nftables"
    subprocess.run([nft, *commands], check=True, capture_output=True, text=True, timeout=10)


def drop_packets(port: int) -> None:
    """Discard every loopback packet to or from ``port`` (both directions of every
    connection through the proxy), in a table of its own."""
    table = f"{NFT_TABLE_PREFIX}{port}"
    _nft("add", "table", "inet", table)
    _nft("add", "chain", "inet", table, "input", "{ type filter hook input priority -10 ; }")
    for match in ("dport", "sport"):
        _nft("add", "rule", "inet", table, "input", "iif", "lo", "tcp", match, str(port), "drop")


def stop_dropping(port: int) -> None:
    with contextlib.suppress(subprocess.CalledProcessError):
        _nft("delete", "table", "inet", f"{NFT_TABLE_PREFIX}{port}")


def remove_leftover_rules() -> None:
    """Delete the tables of proxies a killed test run could not clean up."""
    if shutil.which("nft") is None:
        return
    listing = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=False, timeout=10
    ).stdout
    for line in listing.splitlines():
        family_and_name = line.removeprefix("table ").split()
        if len(family_and_name) == 2 and family_and_name[1].startswith(NFT_TABLE_PREFIX):
            _nft("delete", "table", *family_and_name)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


@contextlib.contextmanager
def proxy_to(port: int) -> Iterator[Proxy]:
    proxy = Proxy(port)
    try:
        yield proxy
    finally:
        proxy.close()
