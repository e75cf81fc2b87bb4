"""The relay as a subprocess: the real command line, real signals, real exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay_tools import exposition
from tests.support.servers import free_port


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 15.0,
    interval: float = 0.02,
    message: str = "condition",
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class RelayProcess:
    def __init__(
        self,
        database_url: str | None,
        nats_url: str,
        environment: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        """``database_url`` None: the settings name it some other way (a file).
        ``environment``: more variables, as they are (``OTEL_*``, say)."""
        self.metrics_port = free_port()
        self.env = {
            **os.environ,
            **({"OUTBOX_RELAY_DATABASE_URL": database_url} if database_url else {}),
            "OUTBOX_RELAY_NATS_URL": nats_url,
            "OUTBOX_RELAY_METRICS_HOST": "127.0.0.1",
            "OUTBOX_RELAY_METRICS_PORT": str(self.metrics_port),
            "OUTBOX_RELAY_LOG_FORMAT": "json",
            "OUTBOX_RELAY_LOG_LEVEL": "info",
        }
        for key, value in settings.items():
            self.env[f"OUTBOX_RELAY_{key.upper()}"] = str(value)
        self.env.update(environment or {})
        self.log_path = Path(tempfile.mkstemp(prefix="relay-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_ready: bool = True) -> RelayProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "relay", "run"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if wait_ready:
            self.wait_ready()
        return self

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5
            ) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, ""

    def ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def wait_ready(self, timeout: float = 20.0) -> None:
        def check() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"relay exited with {self.process.returncode}:\n{self.logs()}")
            return self.ready()

        wait_until(check, timeout, interval=0.05, message="relay readiness")

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        status, text = self.get("/metrics")
        assert status == 200, text
        return exposition.samples(text)

    def metric(self, name: str, **labels: str) -> float:
        key = name
        if labels:
            key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return self.metrics().get(key, 0.0)

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"relay did not stop on SIGTERM:\n{self.logs()}") from None
        return code

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        self.kill()
        self.log_path.unlink(missing_ok=True)


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``outbox-relay ARGS`` against the database at ``url``, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"OUTBOX_RELAY_DATABASE_URL": url, "PATH": "/usr/bin:/bin"},
    )


def run_cli(url: str, *args: str) -> str:
    """What ``outbox-relay ARGS`` printed; it must succeed."""
    result = cli(url, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
