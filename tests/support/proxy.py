"""A small TCP proxy the tests own, for network faults (Toxiproxy cannot be
installed here). Modes:

- ``pass``: forward bytes both ways;
- ``latency``: forward, each chunk delayed by ``latency`` seconds;
- ``blackhole``: keep every connection open but forward nothing, and accept new
  connections without forwarding either (a path that silently eats packets);
- ``reset``: close every connection with RST, and keep resetting new ones;
- ``cut``: close every connection and refuse new ones (nothing listens).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
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
        self._listener: socket.socket | None = None
        self._listen()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.1)
        self._listener = listener

    def set_mode(self, mode: str, latency: float = 0.0) -> None:
        assert mode in ("pass", "latency", "blackhole", "reset", "cut"), mode
        with self._lock:
            self.mode, self.latency = mode, latency
            if mode in ("reset", "cut"):
                for client, upstream in self._pairs:
                    _reset(client)
                    if upstream is not None:
                        _reset(upstream)
                self._pairs.clear()
            if mode == "cut" and self._listener is not None:
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
            if mode == "blackhole":
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
                readable, _, _ = select.select(list(peers), [], [], 0.1)
                with self._lock:
                    mode, latency = self.mode, self.latency
                if mode == "blackhole":
                    continue  # hold the bytes: nothing reaches the other side
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
