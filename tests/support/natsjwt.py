"""An operator-mode NATS trust chain made in the test: operator, account and user
NKeys, their JWTs (v2 claims signed with ed25519, as `nsc` writes them), a
credentials file as NGS or an operator-mode server issues one, and the server
configuration that trusts them through a memory resolver."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_ACCOUNT_LIMITS = {
    **_UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1,
    "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
}  # fmt: skip


@dataclass(frozen=True)
class Identity:
    seed: bytes

    @classmethod
    def new(cls, prefix: int) -> Identity:
        return cls(nkeys.encode_seed(os.urandom(32), prefix))

    @property
    def public_key(self) -> str:
        return str(nkeys.from_seed(bytearray(self.seed)).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(bytearray(self.seed)).sign(data))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def jwt(issuer: Identity, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A NATS v2 JWT: the claims' ``jti`` is the base32 SHA-512/256 of the claims
    without it, and the signature covers ``header.claims`` (nats-io/jwt)."""
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims: dict[str, Any] = {
        "iat": int(time.time()), "iss": issuer.public_key, "name": name, "sub": subject,
        "nats": {**nats, "version": 2},
    }  # fmt: skip
    digest = hashlib.new("sha512_256", json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    body = _b64(json.dumps(claims).encode())
    signature = _b64(issuer.sign(f"{header}.{body}".encode()))
    return f"{header}.{body}.{signature}"


@dataclass(frozen=True)
class OperatorMode:
    """One operator, a system account, an application account with JetStream, and
    users of that account."""

    operator: Identity
    system: Identity
    account: Identity

    @classmethod
    def new(cls) -> OperatorMode:
        return cls(
            Identity.new(nkeys.PREFIX_BYTE_OPERATOR),
            Identity.new(nkeys.PREFIX_BYTE_ACCOUNT),
            Identity.new(nkeys.PREFIX_BYTE_ACCOUNT),
        )

    def server_config(self) -> str:
        operator = jwt(
            self.operator, self.operator.public_key, "test-operator",
            {"type": "operator", "system_account": self.system.public_key},
        )  # fmt: skip
        system = jwt(
            self.operator, self.system.public_key, "SYS",
            {"type": "account", "limits": {**_ACCOUNT_LIMITS, "mem_storage": 0,
                                            "disk_storage": 0, "streams": 0, "consumer": 0}},
        )  # fmt: skip
        account = jwt(
            self.operator, self.account.public_key, "APP",
            {"type": "account", "limits": _ACCOUNT_LIMITS},
        )  # fmt: skip
        return (
            f"operator: {operator}\n"
            f"system_account: {self.system.public_key}\n"
            "resolver: MEMORY\n"
            f"resolver_preload: {{\n  {self.system.public_key}: {system}\n"
            f"  {self.account.public_key}: {account}\n}}\n"
        )

    def credentials(self, path: Path, name: str, permissions: dict[str, Any] | None = None) -> Path:
        """A new user of the application account, written as a credentials file
        (its JWT and its NKey seed) at ``path``, mode 0600."""
        user = Identity.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", **_UNLIMITED, "pub": {}, "sub": {}, **(permissions or {})}
        token = jwt(self.account, user.public_key, name, claims)
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        return path
