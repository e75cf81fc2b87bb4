"""Every `outbox-relay` command the runbooks print (docs/runbooks.md) runs as
printed, with the relay's environment variables, against a deployment with a
dead row: the parser takes it, and it does its work without a traceback."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import wait_until
from tests.support.servers import SHARED_NATS_URL

pytestmark = pytest.mark.integration

RUNBOOKS = Path(__file__).resolve().parents[2] / "docs" / "runbooks.md"


def runbook_commands(text: str) -> list[str]:
    """The ``outbox-relay`` commands of the shell blocks and of the inline code, in
    the page's order, each without its comment, pipe or redirection."""
    found: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        found += [line for line in block.splitlines() if line.startswith("outbox-relay ")]
    # Inline code spans may wrap across a line of the page; one without an option
    # names the command ("`outbox-relay skip` gives up on a row").
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans = [" ".join(span.split()) for span in re.findall(r"`(outbox-relay [^`]+)`", prose)]
    found += [span for span in spans if " --" in span]
    commands = []
    for line in found:
        command = re.split(r"\s+(?:#|\||>)", line, maxsplit=1)[0].strip()
        if command not in commands:
            commands.append(command)
    return commands


def test_the_runbooks_print_the_commands_an_operator_needs():
    commands = runbook_commands(RUNBOOKS.read_text())
    verbs = {shlex.split(c)[1] for c in commands}
    assert verbs >= {"status", "requeue", "skip", "audit", "validate", "install"}, commands


def test_every_command_in_the_runbooks_runs_as_printed(db_url, stream, start_relay, tmp_path):
    good = [Event(stream.subject("runbook"), "entity-1") for _ in range(3)]
    dead = Event("has space", "entity-2")
    relay = start_relay()
    database.insert(db_url, [*good, dead])
    wait_until(
        lambda: database.fetch(
            db_url, "select count(*) from outbox_events where published_at is not null"
        ) == [(3,)] and database.dead_count(db_url, 20) + database.fetch(
            db_url, "select count(*) from outbox_events where relay_dead_at is not null"
        )[0][0] > 0,
        message="three rows published and one dead",
    )  # fmt: skip
    relay.close()
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    environment = {
        **os.environ,
        "OUTBOX_RELAY_DATABASE_URL": db_url,
        "OUTBOX_RELAY_NATS_URL": SHARED_NATS_URL,
        "OUTBOX_RELAY_MAX_ATTEMPTS": "20",
    }
    placeholders = {
        "<uuid>": str(dead.id),
        "<type>": dead.event_type,
        "/etc/outbox-relay/schemas": str(schemas),
    }
    ran = []
    for printed in runbook_commands(RUNBOOKS.read_text()):
        argv = shlex.split(printed)[1:]
        argv = [placeholders.get(arg, arg) for arg in argv]
        result = subprocess.run(
            [sys.executable, "-m", "relay", *argv],
            capture_output=True, text=True, timeout=120, check=False, env=environment,
        )  # fmt: skip
        output = result.stdout + result.stderr
        # 1: found what it looks for (missing messages, invalid rows); 2 and more:
        # the command could not run.
        assert result.returncode in (0, 1), f"{printed}: exit {result.returncode}\n{output}"
        assert "Traceback" not in output, f"{printed}\n{output}"
        ran.append(printed)
    assert len(ran) >= 10, ran
