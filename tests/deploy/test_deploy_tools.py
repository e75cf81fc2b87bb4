"""deploy/, checked with the tools operators use on it: docker-compose, systemd-analyze
and promtool (Debian packages that tests/ensure-environment.sh installs). This tier
needs no server; `make unit` leaves it out so it runs on a machine with neither the
servers nor these tools."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def tool(name: str, package: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} not found: apt-get install {package} (tests/ensure-environment.sh does)"
    return found


def test_compose_file_is_valid_and_complete():
    result = subprocess.run(
        [tool("docker-compose", "docker-compose"), "-f", str(DEPLOY / "docker-compose.yml"),
         "config"], capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"postgres", "nats", "install", "relay-1", "relay-2", "prometheus"}
    assert services["install"]["command"] == ["install"]
    for relay in ("relay-1", "relay-2"):
        assert services[relay]["depends_on"]["install"]["condition"] == (
            "service_completed_successfully"
        )
    assert "sync_interval: always" in (DEPLOY / "nats" / "nats.conf").read_text()


def test_systemd_unit_verifies(tmp_path):
    unit = (DEPLOY / "systemd" / "outbox-relay.service").read_text()
    assert "NoNewPrivileges=yes" in unit
    assert "ProtectSystem=strict" in unit
    assert "DynamicUser=yes" in unit
    # systemd-analyze checks that the commands exist: point them at this checkout's.
    relay = shutil.which("outbox-relay") or str(Path(sys.executable).parent / "outbox-relay")
    env = tmp_path / "env"
    env.write_text("OUTBOX_RELAY_DATABASE_URL=postgresql://localhost/app\n")
    local = unit.replace("/opt/outbox-relay/bin/outbox-relay", relay).replace(
        "/etc/outbox-relay/env", str(env)
    )
    path = tmp_path / "outbox-relay.service"
    path.write_text(local)
    result = subprocess.run(
        [tool("systemd-analyze", "systemd"), "verify", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    problems = [
        line
        for line in result.stderr.splitlines()
        if "outbox-relay.service" in line and "Documentation" not in line
    ]
    assert not problems, result.stderr


@pytest.mark.parametrize(
    ("command", "file"),
    [("check", "alerts.yml"), ("test", "alerts_test.yml")],  # valid; fire as their tests say
)
def test_alert_rules_pass_promtool(command, file):
    result = subprocess.run(
        [tool("promtool", "prometheus"), command, "rules", str(DEPLOY / "prometheus" / file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
