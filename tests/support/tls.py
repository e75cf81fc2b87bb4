"""A certificate authority and a server certificate for 127.0.0.1, made with openssl
for one test, for throwaway servers that take only TLS."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def server_certificates(directory: Path) -> Certificates:
    """A CA, and a certificate it signed for the IP address 127.0.0.1 (what a client
    that verifies the host name checks), with P-256 keys."""
    key_options = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *key_options, "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=outbox-relay test CA", cwd=directory)  # fmt: skip
    _openssl("req", *key_options, "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=directory)  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf",
             cwd=directory)  # fmt: skip
    return Certificates(directory / "ca.crt", directory / "server.crt", directory / "server.key")


def client_certificate(directory: Path, server: Certificates, name: str) -> Certificates:
    """A client certificate for ``name``, signed by ``server``'s CA (for servers that
    verify their clients)."""
    key_options = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *key_options, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(server.ca),
             "-CAkey", str(server.ca.with_suffix(".key")), "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", cwd=directory)  # fmt: skip
    return Certificates(server.ca, directory / f"{name}.crt", directory / f"{name}.key")
