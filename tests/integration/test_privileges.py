"""Least privilege and secured connections: a relay running as a role that `install
--grant-to` prepared does all of its work and nothing more; a role without the
grants is told, in one line, what it lacks; producers need no grant of the relay's;
a Postgres that takes only TLS and passwords is reached by a URL read from a file."""

from __future__ import annotations

import os
import pwd
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.support import database
from tests.support.database import Event
from tests.support.relayproc import RelayProcess, cli, run_cli, wait_until
from tests.support.servers import (
    SHARED_NATS_URL,
    SHARED_PG_URL,
    ThrowawayPostgres,
    throwaway_postgres,
)
from tests.support.tls import Certificates, server_certificates

pytestmark = pytest.mark.integration


def as_role(url: str, role: str) -> str:
    """``url`` logging in as ``role`` (the machine's Postgres trusts loopback)."""
    return url.replace("postgresql://postgres@", f"postgresql://{role}@", 1)


@pytest.fixture
def roles(db_url: str) -> Iterator[dict[str, str]]:
    token = uuid.uuid4().hex[:8]
    names = {kind: f"outbox_{kind}_{token}" for kind in ("relay", "producer", "nobody")}
    for role in names.values():
        database.execute(SHARED_PG_URL, f'create role "{role}" login')
    yield names
    quoted = ", ".join(f'"{role}"' for role in names.values())
    database.execute(db_url, f"drop owned by {quoted}")
    database.execute(SHARED_PG_URL, f"drop role {quoted}")


def test_a_relay_role_granted_by_install_does_its_work_and_no_more(
    db_url, roles, stream, start_relay
):
    result = cli(db_url, "install", "--grant-to", roles["relay"])
    assert result.returncode == 0, result.stdout + result.stderr
    # The application grants its producers what it always did; nothing of the relay's
    # (its sequence numbers their rows: install lets any role do that).
    producer_url = as_role(db_url, roles["producer"])
    database.execute(db_url, f'grant insert on outbox_events to "{roles["producer"]}"')
    good = Event(stream.subject("ok"), "account-1")
    database.insert(producer_url, [good])
    relay_url = as_role(db_url, roles["relay"])
    relay = start_relay(
        database_url=relay_url, retention="1s", retention_interval="200ms", poll_interval="100ms"
    )
    wait_until(lambda: [m.msg_id for m in stream.read()] == [str(good.id)], message="published")
    wait_until(
        lambda: not database.fetch(db_url, "select id from outbox_events"),
        message="retention deleting the spent row",
    )
    # The operator commands, as the same role.
    bad = Event("orders.*", "account-2")  # dead at once
    database.insert(producer_url, [bad])
    wait_until(lambda: relay.metric("outbox_relay_dead_rows") == 1, message="dead row")
    assert "1 dead" in run_cli(relay_url, "status")
    assert "skipped 1 rows" in run_cli(relay_url, "skip", "--id", str(bad.id), "--execute")
    assert "requeued 1 rows" in run_cli(relay_url, "requeue", "--id", str(bad.id), "--execute")
    # And nothing more: no DDL, no writes of events.
    with psycopg.connect(relay_url, autocommit=True) as conn:
        for statement in (
            "truncate outbox_events",
            "alter table outbox_events add column x int",
            "create table relay_was_here (x int)",
            "insert into outbox_events (id, event_type, source, subject, time, data) "
            "values (gen_random_uuid(), 'a.b', 's', 's', now(), '{}')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)


def test_a_role_without_the_grants_is_told_what_it_lacks_in_one_line(db_url, roles, start_relay):
    relay = start_relay(database_url=as_role(db_url, roles["nobody"]), wait_ready=False)
    assert relay.process is not None
    assert relay.process.wait(30) == 2
    [line] = [r["message"] for r in relay.log_records() if r.get("level") == "error"]
    assert "permission denied for table outbox_events" in line
    assert "outbox-relay install --grant-to ROLE" in line


def tls_only(pg: ThrowawayPostgres) -> Certificates:
    """``pg`` (not started) taking TCP connections only over TLS, with a password
    (scram-sha-256); its own unix socket stays open to the test, trusted."""
    certificates = server_certificates(pg.dir)
    if os.geteuid() == 0:  # the server runs as postgres and must own its key
        owner = pwd.getpwnam("postgres")
        for path in (certificates.cert, certificates.key):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    certificates.key.chmod(0o600)
    with open(pg.data / "postgresql.conf", "a") as conf:
        conf.write(f"ssl = on\nssl_cert_file = '{certificates.cert}'\n"
                   f"ssl_key_file = '{certificates.key}'\n")  # fmt: skip
    (pg.data / "pg_hba.conf").write_text(
        "local all all trust\n"
        "hostssl all all 127.0.0.1/32 scram-sha-256\n"
        "host all all 127.0.0.1/32 reject\n"
    )
    return certificates


def test_a_relay_reaches_a_tls_only_postgres_by_a_url_from_a_file(stream, relays, tmp_path):
    with throwaway_postgres(started=False) as pg:
        certificates = tls_only(pg)
        pg.start()
        admin = f"postgresql://postgres@/postgres?host={pg.dir}&port={pg.port}"
        database.install(admin)
        password = f"pw-{uuid.uuid4().hex}"
        database.execute(admin, f"create role relay login password '{password}'")
        run_cli(admin, "install", "--grant-to", "relay")
        url = (
            f"postgresql://relay:{password}@127.0.0.1:{pg.port}/postgres"
            f"?sslmode=verify-full&sslrootcert={certificates.ca}"
        )
        # Without TLS, or with a certificate nobody vouches for, no connection.
        for refused in (
            url.replace("sslmode=verify-full", "sslmode=disable"),
            url.replace(f"sslrootcert={certificates.ca}", "sslrootcert=system"),
        ):
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(refused, connect_timeout=5).close()
        secret = tmp_path / "database-url"
        secret.write_text(url + "\n")
        relay = RelayProcess(None, SHARED_NATS_URL, database_url_file=str(secret))
        relays.append(relay)
        relay.start()
        event = Event(stream.subject("over.tls"), "account-1")
        database.insert(admin, [event])
        wait_until(lambda: [m.msg_id for m in stream.read()] == [str(event.id)], message="sent")
        with psycopg.connect(admin) as conn:
            [(encrypted,)] = conn.execute(
                "select bool_and(ssl) from pg_stat_ssl join pg_stat_activity using (pid) "
                "where usename = 'relay'"
            ).fetchall()
        assert encrypted  # every connection of the relay
        assert password not in relay.logs()
        assert password not in relay.get("/metrics")[1]
        assert relay.stop() == 0
