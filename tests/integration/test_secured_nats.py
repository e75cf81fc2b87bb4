"""The relay against NATS servers that authenticate it: mutual TLS with a user and
password, a token read from a mounted file, an NKey user. Each a throwaway
nats-server on loopback; the relay publishes through it, and a wrong secret is
refused without the secret reaching a log line."""

from __future__ import annotations

import os
import ssl
import uuid

import nkeys
import pytest

from tests.support import database
from tests.support.database import Event
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
