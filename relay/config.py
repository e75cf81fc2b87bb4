"""Configuration: one frozen value, parsed and validated once at the edge.

Every option is a command-line flag and an ``OUTBOX_RELAY_*`` environment
variable; a flag wins over the variable, which wins over the default. Nothing
below the command line reads the environment.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relay import failpoints
from relay.errors import ConfigError
from relay.streams import PUBLISH_MODE_CHOICES

ENV_PREFIX = "OUTBOX_RELAY_"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|min|m|h|d)?\s*$")
_UNIT_SECONDS = {
    "ms": 0.001,
    "s": 1.0,
    "min": 60.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    None: 1.0,
}
# No "$": the names land inside the $$-quoted bodies of sql/install, where "$$" ends one.
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def parse_duration(text: str) -> float:
    """Seconds from ``"250ms"``, ``"1.5"``, ``"30s"``, ``"5m"``, ``"2h"`` or ``"7d"``."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 250ms, 30s, 5m, 2h, 7d)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_table_name(text: str) -> tuple[str, ...]:
    """``"outbox_events"`` or ``"schema.outbox_events"`` as identifier parts."""
    parts = tuple(text.split("."))
    if len(parts) > 2 or not all(_IDENTIFIER.match(part) for part in parts):
        raise ValueError(
            f"not a table name: {text!r} (use name or schema.name: letters, digits and _, "
            "at most 63 each)"
        )
    return parts


def parse_channel(text: str) -> str:
    if not _IDENTIFIER.match(text):
        raise ValueError(f"not a channel name: {text!r} (letters, digits and _, at most 63)")
    return text


def parse_postgres_url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise ValueError("must be a postgresql:// URL")
    return text


def parse_nats_urls(text: str) -> tuple[str, ...]:
    urls = tuple(part.strip() for part in text.split(",") if part.strip())
    if not urls:
        raise ValueError("needs at least one nats:// URL")
    for url in urls:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("nats", "tls") or not parsed.hostname:
            raise ValueError(f"not a nats:// URL: {redact_url(url)}")
        try:
            _ = parsed.port
        except ValueError:
            raise ValueError(f"bad port in {redact_url(url)}") from None
    return urls


# libpq parameters whose values are secrets, in a URI's query or a key=value string.
_SECRET_PARAMETERS = ("password", "sslpassword")
_SECRET_KEYWORD = re.compile(
    r"\b(" + "|".join(_SECRET_PARAMETERS) + r")\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """The URL (or libpq key=value string) with every secret replaced: a password in
    the userinfo, and ``password`` or ``sslpassword`` among its parameters. Safe for
    logs and error messages."""
    if "://" not in url:
        return _SECRET_KEYWORD.sub(r"\1=***", url)
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parsed.password is not None:
        netloc = parsed.netloc.rsplit("@", 1)[1]
        parsed = parsed._replace(netloc=f"{parsed.username or ''}:***@{netloc}")
    if parsed.query:
        pairs = urllib.parse.parse_qsl(parsed.query, keep_blank_values=True)
        query = "&".join(
            f"{urllib.parse.quote(key)}="
            + ("***" if key.lower() in _SECRET_PARAMETERS else urllib.parse.quote(value))
            for key, value in pairs
        )
        parsed = parsed._replace(query=query)
    return urllib.parse.urlunsplit(parsed)


def redact_nats_url(url: str) -> str:
    """A NATS URL safe to show: its password replaced, and a user name without a
    password too, since NATS reads that as a token (nats://TOKEN@host)."""
    try:
        parsed = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parsed.username is not None and parsed.password is None:
        netloc = parsed.netloc.rsplit("@", 1)[1]
        return urllib.parse.urlunsplit(parsed._replace(netloc=f"***@{netloc}"))
    return redact_url(url)


@dataclass(frozen=True)
class Config:
    # Secrets stay out of the repr (a traceback, a debug log): the URL may hold a
    # password, the token is one.
    database_url: str = field(default="postgresql://localhost:5432/postgres", repr=False)
    # A direct (session-capable) connection for LISTEN, the sleep lock and the audit's
    # lock, when database_url is a transaction pooler; unset, database_url serves.
    listen_database_url: str | None = field(default=None, repr=False)
    # "transaction": database_url is a transaction pooler, so nothing is prepared and
    # no setting outlives its transaction; "auto": see relay/poolers.py.
    database_pooler: str = "auto"
    poll_only: bool = False  # no LISTEN at all: the poll alone finds new rows
    envelope: str = "structured"  # CloudEvents content mode: structured or binary
    trace_rows: bool = False  # with tracing on: a span per published row, in its trace
    schemas: str | None = None  # a folder of <event_type>.schema.json (relay/schemas.py)
    schemas_required: bool = False  # a type without a schema is invalid, not unchecked
    nats_urls: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    # How the relay proves who it is to NATS, besides a user and password in the URL.
    nats_creds: str | None = None  # a credentials file: user JWT and NKey seed
    nats_nkey: str | None = None  # a file holding an NKey seed
    nats_token: str | None = field(default=None, repr=False)
    # TLS: the CA to verify the server by (the system's when unset), and a client
    # certificate and key for servers that verify clients.
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    table: tuple[str, ...] = ("outbox_events",)
    channel: str = "outbox_events"
    batch_size: int = 500
    publish_mode: str = "auto"
    poll_interval: float = 1.0
    linger: float = 0.01  # relay/scheduler.py LINGER_MAX
    publish_timeout: float = 5.0
    max_attempts: int = 20
    backoff_base: float = 1.0
    backoff_max: float = 300.0
    retention: float = 7 * 86400.0
    retention_interval: float = 60.0
    retention_batch_size: int = 1000
    partitions_ahead: float = 3 * 86400.0
    audit_interval: float = 0.0  # 0: the relay does not audit the streams
    audit_window: float = 0.0  # 0: the retention window
    listen_keepalive: float = 10.0
    gauge_interval: float = 5.0
    metrics_host: str = "0.0.0.0"  # a service's metrics port must be reachable from the scraper
    metrics_port: int = 9477
    log_level: str = "info"
    log_format: str = "text"
    failpoints: frozenset[str] = field(default_factory=frozenset)

    @property
    def session_database_url(self) -> str:
        """The URL of the connections that need a session of their own."""
        return self.listen_database_url or self.database_url

    @property
    def table_name(self) -> str:
        """The bare table name, which prefixes the relay's own objects."""
        return self.table[-1]

    @property
    def table_display(self) -> str:
        return ".".join(self.table)

    @property
    def audited_window(self) -> float:
        """Seconds an audit looks back: ``audit_window``, or the retention window."""
        return self.audit_window or self.retention


def parse_readable_file(text: str) -> str:
    """A path the relay can read now (a mounted secret or certificate): checked at
    start, so a wrong path is one clear line rather than a failed connection later."""
    path = os.path.expanduser(text)
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {text}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"not readable by this user: {text}")
    return path


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


def _shown_path(path: str | None) -> str:
    return path or ""


def _hidden(secret: str | None) -> str:
    return "***" if secret else ""


def parse_switch(text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"must be a positive whole number, not {text!r}") from None
    if value <= 0:
        raise ValueError("must be a positive whole number")
    return value


def parse_positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise ValueError("must be longer than zero")
    return value


def _duration_or_off(text: str) -> float:
    value = parse_duration(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _show_or_off(value: float) -> str:
    return show_duration(value) if value else "0 (off)"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number from 0 to 65535")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


def _failpoints(text: str) -> frozenset[str]:
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = names - failpoints.KNOWN
    if unknown:
        raise ValueError(f"unknown failpoints: {', '.join(sorted(unknown))}")
    return names


@dataclass(frozen=True)
class Option:
    """One setting: its flag, its variable, how to parse it and what it means."""

    name: str
    parse: Callable[[str], Any]
    help: str
    show: Callable[[Any], str] = str
    # Read from its variable only: no flag, and not in --help or the docs' table.
    test_only: bool = False
    # May come from a file named by its variable + "_FILE" (a mounted secret), read
    # when neither the flag nor the variable itself is given.
    secret_file: bool = False
    # A flag without a value (its variable takes true or false).
    switch: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def env_file(self) -> str:
        return self.env + "_FILE"


def show_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds * 1000:g}ms"


def _duration(name: str, help_text: str) -> Option:
    """An option that takes a positive duration (``500ms``, ``5s``, ``2m``)."""
    return Option(name, parse_positive_duration, help_text, show_duration)


RUN_OPTIONS: tuple[Option, ...] = (
    Option(
        "database_url",
        parse_postgres_url,
        "Postgres URL (libpq URI: TLS and client certificates as its sslmode, sslrootcert, "
        "sslcert, sslkey parameters)",
        redact_url,
        secret_file=True,
    ),
    Option(
        "listen_database_url",
        parse_postgres_url,
        "a direct Postgres URL for LISTEN and the relay's session locks, when --database-url "
        "is a transaction pooler (PgBouncer, RDS Proxy, Supavisor); unset: --database-url",
        lambda url: redact_url(url) if url else "--database-url",
        secret_file=True,
    ),
    Option(
        "database_pooler",
        _choice("auto", "none", "session", "transaction"),
        "what --database-url points at: transaction (a transaction pooler: no prepared "
        "statements, settings per transaction), session or none (a session pooler, or "
        "Postgres), or auto (transaction when --listen-database-url is given or the LISTEN "
        "self-check fails, else none)",
    ),
    Option(
        "poll_only",
        parse_switch,
        "no LISTEN: find new rows by the poll alone (where no session connection is allowed)",
        lambda on: "on" if on else "off",
        switch=True,
    ),
    Option(
        "nats_url",
        parse_nats_urls,
        "NATS server URLs, comma-separated (nats:// or tls://; a user and password in them "
        "authenticate)",
        lambda urls: ",".join(map(redact_nats_url, urls)),
        secret_file=True,
    ),
    Option(
        "nats_creds",
        parse_readable_file,
        "NATS credentials file (user JWT and NKey seed, as operator-mode servers issue)",
        _shown_path,
    ),
    Option("nats_nkey", parse_readable_file, "file holding the NATS user's NKey seed", _shown_path),
    Option("nats_token", _non_empty, "NATS authentication token", _hidden, secret_file=True),
    Option(
        "nats_tls_ca",
        parse_readable_file,
        "CA file to verify the NATS servers by (the system's CAs when unset)",
        _shown_path,
    ),
    Option("nats_tls_cert", parse_readable_file, "client certificate file for NATS", _shown_path),
    Option("nats_tls_key", parse_readable_file, "client key file for NATS", _shown_path),
    Option("table", parse_table_name, "outbox table, optionally schema-qualified", ".".join),
    Option(
        "schemas",
        _non_empty,
        "folder of <event_type>.schema.json files: each row's data is checked before it is "
        "published, and a row that fails goes dead with the reason (reread on SIGHUP)",
        lambda folder: folder or "(none: data is not checked)",
    ),
    Option(
        "schemas_required",
        parse_switch,
        "with --schemas: a row whose event type has no schema is dead too (else published, "
        "and counted)",
        lambda on: "on" if on else "off",
        switch=True,
    ),
    Option("channel", parse_channel, "LISTEN/NOTIFY channel the insert trigger notifies"),
    Option("batch_size", _positive_int, "rows claimed per pass"),
    Option(
        "publish_mode",
        _choice(*PUBLISH_MODE_CHOICES),
        "how batches go to JetStream: auto (fast batches where the stream allows them, "
        "else per message), batch, atomic, or message (one publish and ack per message)",
    ),
    Option(
        "envelope",
        _choice("structured", "binary"),
        "CloudEvents content mode: structured (the JSON envelope is the body) or binary "
        "(the body is the data, each attribute a ce- header)",
    ),
    Option(
        "trace_rows",
        parse_switch,
        "with OpenTelemetry tracing on: also a span per published row whose producer "
        "sampled its trace, in that trace, from created_at to the ack (costs a span a row)",
        lambda on: "on" if on else "off",
        switch=True,
    ),
    _duration("poll_interval", "fallback poll when no notification comes"),
    _duration(
        "linger",
        "under load, the longest the relay waits for more rows before it claims again: "
        "lower for less latency, higher for less CPU per event (docs/performance.md)",
    ),
    _duration(
        "publish_timeout",
        "longest a batch may wait for broker acks (bounds how long row locks are held)",
    ),
    Option(
        "max_attempts",
        _positive_int,
        "refusals of a row before it is dead (the broker's failures never count)",
    ),
    _duration("backoff_base", "first retry delay; doubles per attempt"),
    _duration("backoff_max", "longest retry delay"),
    _duration("retention", "how long published rows are kept"),
    _duration("retention_interval", "how often retention runs"),
    Option("retention_batch_size", _positive_int, "rows deleted per retention statement"),
    _duration(
        "partitions_ahead",
        "on a table partitioned by created_at (`install --partitions`): how far past now "
        "the relay keeps partitions created (at most 100 partitions: every claim locks "
        "each one)",
    ),
    Option(
        "audit_interval",
        _duration_or_off,
        "how often the relay checks that the streams still hold what it marked published "
        "(as `outbox-relay audit` does; 0: never)",
        _show_or_off,
    ),
    Option(
        "audit_window",
        _duration_or_off,
        "how far back an audit looks (0: the retention window)",
        lambda v: show_duration(v) if v else "0 (the retention window)",
    ),
    _duration("listen_keepalive", "quiet time after which the LISTEN connection is probed"),
    _duration("gauge_interval", "how often table-wide gauges are read"),
    Option("metrics_host", str, "address the metrics and health server binds"),
    Option("metrics_port", _port, "port of /metrics, /healthz and /readyz (0 disables)"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "log level"),
    Option("log_format", _choice("text", "json"), "log line format"),
    Option(
        "failpoints",
        _failpoints,
        "comma-separated failpoints to enable (the fault tests' crash windows)",
        lambda v: ",".join(sorted(v)),
        test_only=True,
    ),
)

_FIELD_FOR_OPTION = {"nats_url": "nats_urls"}


def read_secret_file(variable: str, path: str) -> str:
    """A setting from a mounted secret: the file's text without its final newline.
    An error names the variable and the file, never what is in it."""
    try:
        with open(path, encoding="utf-8") as secret:
            return secret.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(variable, f"cannot read {path}: {reason}") from None


def default_value(option: Option) -> Any:
    return getattr(Config(), _FIELD_FOR_OPTION.get(option.name, option.name))


def build_config(
    flags: Mapping[str, str | None], environ: Mapping[str, str], options: tuple[Option, ...]
) -> Config:
    """Merge flags, environment and defaults into a validated :class:`Config`.

    ``flags`` maps option names to the raw text given on the command line, or
    ``None`` where the flag was not given.
    """
    values: dict[str, Any] = {}
    for option in options:
        raw = flags.get(option.name)
        source = option.flag
        if raw is None:
            raw = environ.get(option.env)
            source = option.env
        if option.secret_file and option.env_file in environ:
            if raw is not None:
                raise ConfigError(option.env_file, f"give {source} or {option.env_file}, not both")
            raw, source = (
                read_secret_file(option.env_file, environ[option.env_file]),
                option.env_file,
            )
        if raw is None:
            continue
        try:
            values[_FIELD_FOR_OPTION.get(option.name, option.name)] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(source, str(exc)) from None
    config = Config(**values)
    if (config.nats_tls_cert is None) != (config.nats_tls_key is None):
        raise ConfigError("--nats-tls-cert", "give the client certificate and its key together")
    if config.backoff_max < config.backoff_base:
        raise ConfigError("--backoff-max", "must not be shorter than --backoff-base")
    return config
