"""The runtime package stands apart from the tools: `outbox-relay run` imports no
module of relay_tools (bench, demo, throwaway servers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay import natsinternals
from relay.errors import SetupError


def test_run_imports_no_tool_module():
    process = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "relay", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in process.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "relay.app" in imported  # what `run` does is all there
    assert "relay.batch" in imported
    assert not {name for name in imported if name.startswith("relay_tools")}


def test_a_nats_py_without_the_write_queue_the_relay_uses_fails_the_start_in_one_line():
    # Without the check, every batch would fail as "disconnected": an endless outage.
    class Renamed:
        _write_queue: list[bytes] = []  # noqa: RUF012 - a stand-in, read only
        _pending_data_size = 0
        _transport = None

    with pytest.raises(SetupError, match="no _pending write queue"):
        natsinternals.check(Renamed())  # type: ignore[arg-type]
