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
    for relay in ("relay-1", "relay-2"):
        assert services[relay]["depends_on"]["install"]["condition"] == (
            "service_completed_successfully"
        )
    assert "sync_interval: always" in (DEPLOY / "nats" / "nats.conf").read_text()
    # Secrets are mounted files: each *_FILE variable names a secret the service
    # mounts, and no URL with a password sits in an environment.
    secrets = yaml.safe_load(result.stdout)["secrets"]
    for name, service in services.items():
        mounted = {f"/run/secrets/{s['source']}" for s in service.get("secrets", [])}
        for variable, value in (service.get("environment") or {}).items():
            assert "postgresql://" not in str(value), (name, variable)
            if variable.endswith("_FILE"):
                assert value in mounted, (name, variable)
    for secret in secrets.values():
        assert Path(secret["file"]).is_file(), secret
    assert services["install"]["command"] == ["install", "--grant-to", "outbox_relay"]
    assert [s["source"] for s in services["relay-1"]["secrets"]] == ["relay-database-url"]
    # The runtime role that install grants to, made by the database's first start,
    # is the one (and the password) in the relays' URL.
    role_sql = (DEPLOY / "docker" / "initdb" / "10-relay-role.sql").read_text()
    url = Path(secrets["relay-database-url"]["file"]).read_text().strip()
    assert f"create role outbox_relay login password '{url.split(':')[2].split('@')[0]}'" in (
        role_sql
    )
    assert url.startswith("postgresql://outbox_relay:")
    owner_url = Path(secrets["install-database-url"]["file"]).read_text().strip()
    password = Path(secrets["postgres-password"]["file"]).read_text().strip()
    user = services["postgres"]["environment"]["POSTGRES_USER"]
    assert owner_url.startswith(f"postgresql://{user}:{password}@postgres:5432/")


def test_systemd_units_verify_and_take_secrets_as_credentials(tmp_path):
    units = {
        name: (DEPLOY / "systemd" / name).read_text()
        for name in ("outbox-relay.service", "outbox-relay-install.service")
    }
    relay, install = units["outbox-relay.service"], units["outbox-relay-install.service"]
    for unit in units.values():
        assert "NoNewPrivileges=yes" in unit
        assert "ProtectSystem=strict" in unit
        assert "DynamicUser=yes" in unit
        assert "Environment=OUTBOX_RELAY_DATABASE_URL_FILE=%d/database-url" in unit
    # Each unit loads its own database URL; only install's is the owner's.
    assert "LoadCredential=database-url:/etc/outbox-relay/database-url\n" in relay
    assert "LoadCredential=database-url:/etc/outbox-relay/install-database-url\n" in install
    assert "install-database-url" not in relay.split("[Unit]")[1]
    assert "Environment=OUTBOX_RELAY_NATS_CREDS=%d/nats.creds" in relay
    assert "ExecStart=/opt/outbox-relay/bin/outbox-relay install --grant-to outbox_relay" in install
    assert "Requires=outbox-relay-install.service" in relay
    # systemd-analyze checks that the commands and credential files exist: point
    # them at this checkout's command and at files in tmp_path.
    command = shutil.which("outbox-relay") or str(Path(sys.executable).parent / "outbox-relay")
    env = tmp_path / "env"
    env.write_text("OUTBOX_RELAY_NATS_URL=nats://localhost:4222\n")
    for name in ("database-url", "install-database-url", "nats.creds"):
        (tmp_path / name).write_text("secret\n")
    paths = []
    for name, unit in units.items():
        path = tmp_path / name
        path.write_text(
            unit.replace("/opt/outbox-relay/bin/outbox-relay", command)
            .replace("/etc/outbox-relay/env", str(env))
            .replace("/etc/outbox-relay/", f"{tmp_path}/")
        )
        paths.append(str(path))
    result = subprocess.run(
        [tool("systemd-analyze", "systemd"), "verify", *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    problems = [
        line
        for line in result.stderr.splitlines()
        if "outbox-relay" in line and "Documentation" not in line
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
