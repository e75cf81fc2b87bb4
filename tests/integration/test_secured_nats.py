"""The relay against NATS servers that authenticate it: mutual TLS with a user and
password, a token read from a mounted file, an NKey user, a credentials file of an
operator-mode server; and a user with only the documented permissions. Each a
throwaway nats-server on loopback; the relay publishes through it, and a wrong
secret is refused without the secret reaching a log line."""

from __future__ import annotations

import os
import re
import ssl
import uuid
from pathlib import Path

import nkeys
import pytest

from tests.support import database
from tests.support.database import Event
from tests.support.natsjwt import OperatorMode
from tests.support.relayproc import wait_until
from tests.support.servers import ThrowawayNats
from tests.support.stream import TestStream
from tests.support.tls import client_certificate, server_certificates

pytestmark = pytest.mark.integration


def publishes_through(db_url, start_relay, stream: TestStream, nats_url: str, **settings):
    relay = start_relay(nats_url=nats_url, **settings)
    event = Event(stream.subject("secured"), "account-1")
    database.insert(db_url, [event])
    wait_until(lambda: [m.msg_id for m in stream.read()] == [str(event.id)], message="published")
    return relay


def refused(start_relay, nats_url: str, **settings):
    """A relay that cannot get in: not ready, saying NATS is not connected, and
    logging why (the server's refusal, or the failed handshake) as it retries."""
    relay = start_relay(nats_url=nats_url, wait_ready=False, **settings)

    def refusal_seen() -> bool:
        broker_lines = [r for r in relay.log_records() if r.get("logger") == "relay.broker"]
        return bool(broker_lines) and relay.get("/readyz") == (
            503,
            "not ready: NATS is not connected\n",
        )

    wait_until(refusal_seen, message="the refusal: not ready, and logged")
    return relay


def test_mutual_tls_with_a_user_and_password(db_url, start_relay, tmp_path):
    server_certs = server_certificates(tmp_path)
    client = client_certificate(tmp_path, server_certs, "relay")
    password = f"pw-{uuid.uuid4().hex}"
    nats = ThrowawayNats(
        extra_config=(
            f'tls {{\n  cert_file: "{server_certs.cert}"\n  key_file: "{server_certs.key}"\n'
            f'  ca_file: "{server_certs.ca}"\n  verify: true\n}}\n'
            f'authorization {{\n  user: "relay"\n  password: "{password}"\n}}\n'
        )
    )
    try:
        nats.start()
        context = ssl.create_default_context(cafile=str(server_certs.ca))
        context.load_cert_chain(str(client.cert), str(client.key))
        url = f"tls://relay:{password}@127.0.0.1:{nats.port}"
        stream = TestStream(url, connect={"tls": context})
        tls = {
            "nats_tls_ca": str(client.ca),
            "nats_tls_cert": str(client.cert),
            "nats_tls_key": str(client.key),
        }
        relay = publishes_through(db_url, start_relay, stream, url, **tls)
        assert password not in relay.logs()
        # No client certificate: the server refuses the handshake.
        refused(start_relay, url, nats_tls_ca=str(client.ca))
        # The wrong password, with the certificate: refused, and never logged.
        wrong = refused(start_relay, url.replace(password, "not-the-password"), **tls)
        assert "not-the-password" not in wrong.logs()
    finally:
        nats.destroy()


def test_a_token_from_a_mounted_file(db_url, start_relay, tmp_path):
    token = f"t0k-{uuid.uuid4().hex}"
    nats = ThrowawayNats(extra_config=f'authorization {{\n  token: "{token}"\n}}\n')
    try:
        nats.start()
        stream = TestStream(nats.url, connect={"token": token})
        secret = tmp_path / "nats-token"
        secret.write_text(token + "\n")
        relay = publishes_through(db_url, start_relay, stream, nats.url, nats_token_file=secret)
        assert token not in relay.logs()
        assert token not in relay.get("/metrics")[1]
        (tmp_path / "wrong").write_text("not-the-token\n")
        wrong = refused(start_relay, nats.url, nats_token_file=tmp_path / "wrong")
        assert "not-the-token" not in wrong.logs()
    finally:
        nats.destroy()


def test_an_nkey_user(db_url, start_relay, tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    user = nkeys.from_seed(bytearray(seed)).public_key.decode()
    nats = ThrowawayNats(extra_config=f'authorization {{\n  users: [ {{ nkey: "{user}" }} ]\n}}\n')
    try:
        nats.start()
        seed_file = tmp_path / "relay.nk"
        seed_file.write_bytes(seed + b"\n")
        seed_file.chmod(0o600)
        stream = TestStream(nats.url, connect={"nkeys_seed": str(seed_file)})
        relay = publishes_through(db_url, start_relay, stream, nats.url, nats_nkey=seed_file)
        assert seed.decode() not in relay.logs()
        # Another user's seed: refused.
        other = tmp_path / "other.nk"
        other.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
        refused(start_relay, nats.url, nats_nkey=other)
    finally:
        nats.destroy()


SECURITY = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def readme_block(marker: str) -> str:
    """The code block after ``<!-- marker -->`` on the security page, comments dropped."""
    text = SECURITY.read_text()
    return re.sub(r"#.*", "", text[text.index(f"<!-- {marker} -->\n") :].split("```")[1])


def quoted(text: str) -> list[str]:
    return re.findall(r'"([^"]+)"', text)


def documented_permissions(
    subjects: list[str], *, audit: bool = False
) -> tuple[list[str], list[str]]:
    """The security page's permission block for the relay's NATS user, as (publish,
    subscribe) allow lists, with ``subjects`` in place of its example event types;
    with ``audit``, and the block the audit adds."""
    block = readme_block("nats-permissions")
    publish, subscribe = (
        quoted(re.search(rf"{kind}:\s*{{\s*allow:\s*\[(.*?)\]", block, re.S)[1])
        for kind in ("publish", "subscribe")
    )
    assert publish[:2] == ["orders.>", "payments.>"], publish
    if audit:
        publish += quoted(readme_block("nats-permissions-audit"))
    return subjects + publish[2:], subscribe


def conf_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def test_a_user_with_only_the_documented_permissions(db_url, start_relay):
    """The documented block is all the relay needs: it publishes, checks the streams'
    duplicate windows, and learns that no stream captures a subject. A subject the
    block does not allow is the broker's refusal: settled at once, never counted."""
    token = uuid.uuid4().hex[:10]
    publish, subscribe = documented_permissions([f"t{token}.>", f"x{token}.>"])
    auditing, _ = documented_permissions([f"t{token}.>"], audit=True)
    nats = ThrowawayNats(
        extra_config=(
            'authorization {\n  users: [\n    { user: "admin", password: "admin" }\n'
            '    { user: "relay", password: "relay", permissions: {\n'
            f"      publish: {{ allow: {conf_list(publish)} }}\n"
            f"      subscribe: {{ allow: {conf_list(subscribe)} }}\n    }} }}\n"
            '    { user: "auditing", password: "auditing", permissions: {\n'
            f"      publish: {{ allow: {conf_list(auditing)} }}\n"
            f"      subscribe: {{ allow: {conf_list(subscribe)} }}\n    }} }}\n"
            '    { user: "unadvised", password: "unadvised", permissions: {\n'
            f"      publish: {{ allow: {conf_list(publish)} }}\n"
            '      subscribe: { allow: ["_INBOX.>"] }\n    } }\n  ]\n}\n'
        )
    )
    try:
        nats.start()
        stream = TestStream(f"nats://admin:admin@127.0.0.1:{nats.port}", token=token)
        relay = publishes_through(
            db_url, start_relay, stream, f"nats://relay:relay@127.0.0.1:{nats.port}"
        )
        assert "could not check the streams' duplicate windows" not in relay.logs()
        assert "violation" not in relay.logs()
        uncaptured = Event(f"x{token}.nowhere", "account-2")
        denied = Event(f"y{token}.denied", "account-3")
        database.insert(db_url, [uncaptured, denied])
        wait_until(
            lambda: (
                relay.metric("outbox_relay_subjects_without_stream") == 1
                and relay.metric(
                    "outbox_relay_publish_failures_total",
                    event_type=denied.event_type,
                    reason="permission_denied",
                )
            ),
            message="the uncaptured subject reported, and the denied one settled as denied",
        )
        assert not relay.metric(
            "outbox_relay_publish_failures_total", event_type=denied.event_type, reason="timeout"
        )
        warning = f'permissions violation for publish to "{denied.event_type}"'
        assert any(warning in r["message"] for r in relay.log_records()), relay.logs()
        ids = [str(uncaptured.id), str(denied.id)]
        waiting = database.fetch(
            db_url,
            "select attempts, relay_dead_at is null from outbox_events where id = any(%s::uuid[])",
            (ids,),
        )
        assert waiting == [(0, True), (0, True)]
        database.execute(db_url, "delete from outbox_events where id = any(%s::uuid[])", (ids,))
        # The audit's block: a relay that audits as a user with both reads the stream.
        relay.stop()
        auditor = start_relay(
            nats_url=f"nats://auditing:auditing@127.0.0.1:{nats.port}", audit_interval="200ms"
        )
        wait_until(
            lambda: auditor.metric("outbox_relay_audit_checked_rows") == 1,
            message="an audit as the auditing user",
        )
        assert auditor.metric("outbox_relay_audit_failures_total") == 0, auditor.logs()
        # Without the advisories' subscription the relay still publishes, and says why
        # a stream's change reaches it only with the periodic read.
        auditor.stop()
        database.execute(db_url, "delete from outbox_events")
        unadvised = start_relay(nats_url=f"nats://unadvised:unadvised@127.0.0.1:{nats.port}")
        event = Event(stream.subject("unadvised"), "account-4")
        database.insert(db_url, [event])
        wait_until(lambda: str(event.id) in [m.msg_id for m in stream.read()], message="published")
        assert "permissions violation for subscription" in unadvised.logs()
    finally:
        nats.destroy()


def test_a_credentials_file_from_an_operator_mode_server(db_url, start_relay, tmp_path):
    """A user JWT and NKey seed in one file, as `nsc` or Synadia Cloud issue it, for a
    user of an account that the server trusts through its operator; the user holds
    the documented permissions. A user of an account the server does not know is
    refused."""
    trust = OperatorMode.new()
    token = uuid.uuid4().hex[:10]
    publish, subscribe = documented_permissions([f"t{token}.>"])
    nats = ThrowawayNats(extra_config=trust.server_config())
    try:
        nats.start()
        admin = trust.credentials(tmp_path / "admin.creds", "admin")
        stream = TestStream(nats.url, connect={"user_credentials": str(admin)}, token=token)
        creds = trust.credentials(
            tmp_path / "relay.creds",
            "relay",
            {"pub": {"allow": publish}, "sub": {"allow": subscribe}},
        )
        relay = publishes_through(db_url, start_relay, stream, nats.url, nats_creds=creds)
        seed = creds.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
        assert seed.startswith("SU")
        assert seed not in relay.logs()
        assert "could not check the streams' duplicate windows" not in relay.logs()
        assert "violation" not in relay.logs()
        stranger = OperatorMode.new().credentials(tmp_path / "stranger.creds", "relay")
        refused(start_relay, nats.url, nats_creds=stranger)
    finally:
        nats.destroy()
