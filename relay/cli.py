"""The command line: the only place that reads flags and the environment."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import nats.errors
import psycopg

from relay import __version__, app, audit, backlog, database, schemas, sqlfiles, validate
from relay.config import (
    RUN_OPTIONS,
    Config,
    Option,
    build_config,
    default_value,
    parse_positive_duration,
    redact_url,
)
from relay.errors import ConfigError, RelayError, SetupError, first_line
from relay.logs import setup_logging

log = logging.getLogger("relay")

# The options each command takes; `run` takes them all.
_SQL_OPTIONS = ("database_url", "table", "channel", "log_level", "log_format")
_OPERATOR_OPTIONS = (*_SQL_OPTIONS, "max_attempts")
OPERATOR_COMMANDS = ("status", "requeue", "skip")
# relay_tools.bench.soak.HOLDERS, named here so that `run` never imports the tools.
SOAK_HOLDERS = ("report", "writer", "outbox-writer", "prepared", "standby")
_NATS_OPTIONS = (
    "nats_url", "nats_creds", "nats_nkey", "nats_token", "nats_tls_ca", "nats_tls_cert",
    "nats_tls_key",
)  # fmt: skip
_VALIDATE_OPTIONS = (*_SQL_OPTIONS, "schemas", "schemas_required")
# --publish-timeout: how long after its message was stored a row may be marked.
_AUDIT_OPTIONS = (
    *_SQL_OPTIONS, *_NATS_OPTIONS, "publish_timeout", "retention", "audit_window", "envelope",
)  # fmt: skip


def _options_for(command: str) -> tuple[Option, ...]:
    if command == "install":
        return tuple(o for o in RUN_OPTIONS if o.name in (*_SQL_OPTIONS, "partitions_ahead"))
    if command == "uninstall":
        return tuple(o for o in RUN_OPTIONS if o.name in _SQL_OPTIONS)
    if command in OPERATOR_COMMANDS:
        return tuple(o for o in RUN_OPTIONS if o.name in _OPERATOR_OPTIONS)
    if command == "audit":
        return tuple(o for o in RUN_OPTIONS if o.name in _AUDIT_OPTIONS)
    if command == "validate":
        return tuple(o for o in RUN_OPTIONS if o.name in _VALIDATE_OPTIONS)
    return RUN_OPTIONS


def _duration(text: str) -> float:
    try:
        return parse_positive_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _period(text: str) -> float:
    seconds = _duration(text)
    if seconds < 60:
        raise argparse.ArgumentTypeError("a partition period is at least 1min")
    return seconds


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a uuid: {text!r}") from None


def _add_window_and_json(parser: argparse.ArgumentParser, since_help: str) -> None:
    """The window and the output format of a command that reads rows back."""
    parser.add_argument("--since", type=_duration, metavar="DURATION", help=since_help)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for option in options:
        if option.test_only:
            continue
        described = (
            f"{option.help} [env {option.env}; default {option.show(default_value(option))}]"
        )
        if option.switch:
            parser.add_argument(
                option.flag, dest=option.name, action="store_const", const="true", help=described
            )
            continue
        parser.add_argument(
            option.flag,
            dest=option.name,
            default=None,
            metavar=option.name.split("_")[-1].upper(),
            help=described,
        )


def _add_row_change_options(parser: argparse.ArgumentParser, command: str) -> None:
    """--execute and the settings of a command that changes rows (a dry run without)."""
    parser.add_argument(
        "--execute",
        action="store_true",
        help="change the rows (without it, only show what would change)",
    )
    _add_options(parser, _options_for(command))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-relay",
        description="Move committed outbox rows from Postgres to NATS JetStream.",
    )
    parser.add_argument("--version", action="version", version=f"outbox-relay {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("run", help="run the relay until SIGTERM or SIGINT")
    _add_options(run, _options_for("run"))
    for name, text in (
        ("install", "create the table (if absent), the relay's columns and the trigger"),
        ("uninstall", "remove the trigger, its function and the relay's indexes"),
    ):
        sql_command = commands.add_parser(name, help=text)
        sql_command.add_argument(
            "--print", action="store_true", help="write the SQL to stdout instead"
        )
        if name == "install":
            sql_command.add_argument(
                "--grant-to",
                metavar="ROLE",
                help="also grant ROLE what `run`, `status`, `requeue` and `skip` need, "
                "and nothing more (no DDL)",
            )
            sql_command.add_argument(
                "--partitions",
                type=_period,
                metavar="PERIOD",
                help="create the table (when absent) range-partitioned on created_at, one "
                "partition per PERIOD (1h, 1d; at least 1min), and the partitions "
                "--partitions-ahead past now; the relay keeps creating them and its "
                "retention drops expired ones (docs/partitions.md)",
            )
        _add_options(sql_command, _options_for(name))
    status = commands.add_parser(
        "status",
        help="backlog per event type (unpublished, dead, skipped, oldest, attempts) "
        "and the subjects dead rows hold back",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_options(status, _options_for("status"))
    requeue = commands.add_parser(
        "requeue",
        help="reset attempts and backoff of dead rows, so they are published before the "
        "rows they hold back (a dry run unless --execute)",
    )
    requeue.add_argument(
        "--id",
        type=_uuid,
        action="append",
        default=[],
        metavar="UUID",
        help="an unpublished row to retry now (dead, skipped or backing off); repeatable",
    )
    requeue.add_argument(
        "--event-type",
        action="append",
        default=[],
        metavar="TYPE",
        help="the dead rows of this event type; repeatable",
    )
    requeue.add_argument("--all-dead", action="store_true", help="every dead row")
    _add_row_change_options(requeue, "requeue")
    skip = commands.add_parser(
        "skip",
        help="give up on rows: keep them unpublished and release the subject they hold "
        "back (a dry run unless --execute)",
    )
    skip.add_argument(
        "--id",
        type=_uuid,
        action="append",
        default=[],
        required=True,
        metavar="UUID",
        help="an unpublished row to give up on; repeatable",
    )
    _add_row_change_options(skip, "skip")
    audit = commands.add_parser(
        "audit",
        help="check that the streams still hold every row marked published in a window; "
        "exit 1 when some are missing",
        description="Reads, headers only, what the streams that capture the relay's "
        "event types hold, and compares it with the rows marked published. A message "
        "that one of its stream's limits removed is counted apart, not missing. On a "
        "partitioned table it also looks for envelope ids written more than once. Exit "
        "status: 0 nothing missing, 1 rows missing (repaired or not) or ids written twice, "
        "2 a usage or connection error.",
    )
    _add_window_and_json(audit, "how far back to look (default: --audit-window, else --retention)")
    audit.add_argument(
        "--repair",
        action="store_true",
        help="publish every missing row again, in per-subject order, with its envelope id "
        "unchanged (consumers dedupe it)",
    )
    _add_options(audit, _options_for("audit"))
    validate_command = commands.add_parser(
        "validate",
        help="check the rows in the table against --schemas; exit 1 when some are invalid",
        description="Reads every row (published or not) written in the window through a "
        "server-side cursor, locking nothing, and checks its data against its event type's "
        "schema. Exit status: 0 all valid, 1 some invalid (listed with their reasons), 2 a "
        "usage or connection error.",
    )
    _add_window_and_json(validate_command, "only rows written this recently")
    _add_options(validate_command, _options_for("validate"))
    bench = commands.add_parser(
        "bench",
        help="measure the relay against Postgres and NATS floors and the plain poller",
        description="Starts throwaway Postgres and NATS servers on loopback (unless "
        "--database-url / --nats-url name servers to use: it creates and drops a database "
        "and a stream of its own there) and prints every figure, with the targets.",
    )
    _add_bench_arguments(bench)
    demo = commands.add_parser(
        "demo",
        help="see it work: throwaway servers, a producer, the relay and a consumer",
        description="Uses OUTBOX_RELAY_DATABASE_URL / OUTBOX_RELAY_NATS_URL when set, "
        "throwaway loopback servers otherwise. Stops and removes everything on Ctrl-C.",
    )
    demo.add_argument("--rate", type=float, default=50.0, help="orders per second (default 50)")
    demo.add_argument("--seconds", type=float, help="stop by itself after this long")
    return parser


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[argparse.Namespace, Config]:
    args = build_parser().parse_args(argv)
    options = _options_for(args.command)
    config = build_config({o.name: getattr(args, o.name, None) for o in options}, environ, options)
    return args, config


def _sql_command(args: argparse.Namespace, config: Config) -> int:
    names = sqlfiles.Names.for_config(config)
    install = args.command == "install"
    grant_to = args.grant_to if install else None
    partitions = args.partitions if install else None
    if args.print:
        statements = (
            sqlfiles.install_script(names) if install else [sqlfiles.uninstall_script(names)]
        )
        if partitions is not None:
            statements = [
                sqlfiles.partition_statement(names, "create_table"),
                *statements,
                *database.first_partitions(names, partitions, config.partitions_ahead, time.time()),
            ]
        if grant_to is not None:
            statements.append(sqlfiles.grant_script(names, grant_to))
        sys.stdout.write("\n".join(s.as_string() for s in statements) + "\n")
        return 0
    conninfo = database.connection_string(config.database_url)
    try:
        if install:
            database.install(conninfo, names, grant_to, partitions, config.partitions_ahead)
        else:
            database.uninstall(conninfo, names)
    except (psycopg.Error, SetupError) as exc:
        log.error(
            "%s failed on %s: %s", args.command, redact_url(config.database_url), first_line(exc)
        )
        return 1
    log.info(
        "%s done on %s (table %s)",
        args.command,
        redact_url(config.database_url),
        config.table_display,
    )
    return 0


def _operator_command(args: argparse.Namespace, config: Config) -> int:
    conninfo = database.connection_string(config.database_url)
    try:
        if args.command == "status":
            status = backlog.read_status(conninfo, config)
            rendered = backlog.status_json(status) if args.json else None
            sys.stdout.write(rendered or backlog.render_status(status, config))
            return 0
        if args.command == "skip":
            outcome = backlog.skip(conninfo, config, ids=args.id, execute=args.execute)
            sys.stdout.write(backlog.render_skip(outcome, args.id, execute=args.execute))
            return 0
        if not (args.id or args.event_type or args.all_dead):
            print(
                "outbox-relay: error: requeue needs --id, --event-type or --all-dead",
                file=sys.stderr,
            )
            return 2
        result = backlog.requeue(
            conninfo,
            config,
            ids=args.id,
            event_types=args.event_type,
            all_dead=args.all_dead,
            execute=args.execute,
        )
    except psycopg.Error as exc:
        log.error(
            "%s failed on %s: %s", args.command, redact_url(config.database_url), first_line(exc)
        )
        return 1
    for row in result.matched:
        note = "  (was skipped: goes out after rows published since)" if row["skipped"] else ""
        print(
            f"{row['id']}  {row['event_type'] or '(empty)'}  attempts={row['attempts']}  "
            f"{row['last_error'] or ''}".rstrip()
            + note
        )
    if args.execute:
        print(f"requeued {result.reset} rows")
    else:
        print(f"{len(result.matched)} rows would be requeued (dry run: add --execute)")
    return 0


def _audit(args: argparse.Namespace, config: Config) -> int:
    since = args.since or config.audited_window
    try:
        report = asyncio.run(audit.audit_once(config, since, repair=args.repair))
    except (audit.AuditError, RelayError, psycopg.Error, OSError, nats.errors.Error) as exc:
        log.error("audit failed: %s", first_line(exc))
        return 2
    sys.stdout.write(report.as_json() + "\n" if args.json else report.summary())
    return 1 if report.missing or report.duplicate_ids else 0


def _validate(args: argparse.Namespace, config: Config) -> int:
    if not config.schemas:
        print("outbox-relay: error: validate needs --schemas DIR", file=sys.stderr)
        return 2
    try:
        loaded = schemas.Schemas.load(config.schemas, required=config.schemas_required)
        report = validate.validate_table(
            database.connection_string(config.database_url), config, loaded, args.since
        )
    except (RelayError, psycopg.Error) as exc:
        log.error("validate failed: %s", first_line(exc))
        return 2
    sys.stdout.write(report.as_json() + "\n" if args.json else report.summary())
    return 1 if report.invalid_count else 0


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "mode",
        nargs="?",
        choices=("steady",),
        help="steady: the relay's CPU, database transactions and statements per event and "
        "p50/p99 at steady rates (about 30 s a rate and build)",
    )
    bench.add_argument("--database-url", help="a Postgres server to use instead of a throwaway one")
    bench.add_argument("--nats-url", help="a NATS server to use instead of a throwaway one")
    bench.add_argument("--quick", action="store_true", help="a few seconds, tiny sizes (CI)")
    bench.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    bench.add_argument(
        "--soak",
        action="store_true",
        help="instead: sustained load while a snapshot holds the vacuum horizon, "
        "p50/p99 per window before, during and after (about 8 minutes)",
    )
    bench.add_argument(
        "--plot",
        metavar="DIR",
        help="also write PNG charts of the figures into DIR (needs the bench extra)",
    )
    bench.add_argument(
        "--from-json",
        metavar="FILE",
        help="with --plot: chart the figures a run wrote with --json, without running",
    )
    bench.add_argument(
        "--poolers",
        action="store_true",
        help="instead: the relay behind PgBouncer in transaction mode against direct, "
        "drain and latency (about 6 minutes; needs pgbouncer)",
    )
    bench.add_argument(
        "--features",
        action="store_true",
        help="instead: what --schemas, trace context and headers, and tracing on cost the "
        "drain (about 6 minutes; tracing needs the otel extra)",
    )
    bench.add_argument(
        "--hostile",
        action="store_true",
        help="instead: rows and settings Postgres accepts that once broke the relay, one at "
        "a time beside steady load, on a non-ISO DateStyle (about 2 minutes)",
    )
    bench.add_argument(
        "--dashboard",
        action="store_true",
        help="instead: the Grafana dashboard's panels through a real run (two relays, a "
        "real Prometheus, the broker down for 30 s), drawn with --plot (about 3 minutes; "
        "needs prometheus)",
    )
    bench.add_argument(
        "--hold", type=_duration, metavar="DURATION", help="with --soak: how long (default 5m)"
    )
    bench.add_argument(
        "--rate", type=float, metavar="N", help="with --soak: events/s (default 1500)"
    )
    bench.add_argument(
        "--holder",
        choices=SOAK_HOLDERS,
        help="with --soak: what holds the horizon (default report): a repeatable-read "
        "report, a writer idle in its transaction, a writer of an outbox row committing at "
        "the end, a prepared transaction that wrote one, a report on a hot standby",
    )
    bench.add_argument(
        "--partitions",
        type=_period,
        metavar="PERIOD",
        help="with --soak: also the soak on a table partitioned by PERIOD (retention drops "
        "partitions), after the plain table's, and the two compared (WAL, size, p99); with "
        "steady: this build also on a table partitioned by PERIOD, 3 days of them ahead",
    )
    bench.add_argument(
        "--without-start-key",
        action="store_true",
        help="with --soak: also the soak with every claim walking from the claim index's "
        "first entry (the claim before the start key), after the plain table's, and the "
        "p99 of the two charted with --plot",
    )
    bench.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="with --soak or steady: relays sharing the table (default 1)",
    )
    bench.add_argument(
        "--rates",
        type=_rates,
        metavar="N,N,...",
        help="with steady: events/s to run at (default 200,1000,3000)",
    )
    bench.add_argument(
        "--seconds", type=float, metavar="S", help="with steady: seconds measured a rate (20)"
    )
    bench.add_argument(
        "--window",
        type=float,
        metavar="S",
        help="with steady: also CPU per event in windows of S seconds (does it grow?)",
    )
    bench.add_argument(
        "--producer-ratio",
        type=int,
        metavar="N",
        help="with steady: also producers' commits/s on the installed table and each of "
        "its parts against the contract's table (pgbench, in turns, N times)",
    )
    bench.add_argument(
        "--compare",
        metavar="DIR",
        help="with steady: also run the relay of the checkout in DIR, in turns with this build",
    )


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive: {text!r}")
    return rates


# The tools (relay_tools) are imported only by the commands that use them: they
# start servers, and `outbox-relay run` has no use for them.
def _bench(args: argparse.Namespace) -> int:  # noqa: PLR0911 - a return per bench mode
    from relay_tools.bench.command import main as bench_main  # noqa: PLC0415
    from relay_tools.localservers import MissingServerBinary  # noqa: PLC0415

    setup_logging("warning", "text")
    if args.plot:
        return _bench_and_plot(args)
    try:
        if args.mode == "steady":
            return _bench_steady(args)
        if args.soak:
            return _bench_soak(args)
        if args.features:
            from relay_tools.bench import features  # noqa: PLC0415

            features_plan = features.FeaturesPlan.quick() if args.quick else features.FeaturesPlan()
            return features.main(args.database_url, args.nats_url, features_plan, args.json)
        if args.dashboard:
            from relay_tools.bench import dashboard  # noqa: PLC0415

            plan = dashboard.DashboardPlan.quick() if args.quick else dashboard.DashboardPlan()
            return dashboard.main(plan, args.json)
        if args.hostile:
            from relay_tools.bench import hostile  # noqa: PLC0415

            hostile_plan = hostile.HostilePlan.quick() if args.quick else hostile.HostilePlan()
            return hostile.main(args.database_url, args.nats_url, hostile_plan, args.json)
        if args.poolers:
            from relay_tools.bench import poolers  # noqa: PLC0415

            pooler_plan = poolers.PoolerPlan.quick() if args.quick else poolers.PoolerPlan()
            return poolers.main(args.database_url, args.nats_url, pooler_plan, args.json)
        return bench_main(args.database_url, args.nats_url, args.quick, args.json)
    except MissingServerBinary as exc:
        print(f"outbox-relay bench: {exc}", file=sys.stderr)
        return 1


def _bench_soak(args: argparse.Namespace) -> int:
    from relay_tools.bench import soak  # noqa: PLC0415

    plan = soak.SoakPlan.quick() if args.quick else soak.SoakPlan()
    if args.hold is not None:
        plan = dataclasses.replace(plan, hold=args.hold)
    if args.rate is not None:
        plan = dataclasses.replace(plan, rate=args.rate)
    if args.holder is not None:
        plan = dataclasses.replace(plan, holder=args.holder)
    if args.replicas is not None:
        plan = dataclasses.replace(plan, replicas=args.replicas)
    if args.partitions is not None:
        plan = plan.for_layouts(args.partitions)
    if args.without_start_key:
        plan = dataclasses.replace(plan, without_start_key=True)
    return soak.main(args.database_url, args.nats_url, plan, args.json)


def _bench_steady(args: argparse.Namespace) -> int:
    from relay_tools.bench import steady  # noqa: PLC0415

    plan = steady.SteadyPlan.quick() if args.quick else steady.SteadyPlan()
    for name in ("rates", "seconds", "window", "compare", "replicas", "partitions"):
        if getattr(args, name) is not None:
            plan = dataclasses.replace(plan, **{name: getattr(args, name)})
    if args.producer_ratio is not None:
        plan = dataclasses.replace(plan, producer_repetitions=args.producer_ratio)
    return steady.main(args.database_url, args.nats_url, plan, args.json)


def _bench_and_plot(args: argparse.Namespace) -> int:
    """``bench --plot DIR``: the run (unless ``--from-json``), then its charts."""
    from relay_tools.bench import plots  # noqa: PLC0415

    source = args.from_json
    code = 0
    if source is None:
        if args.poolers or args.features or args.hostile:
            print("outbox-relay bench: --plot charts the bench and the soak", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as scratch:
            source = args.json or str(Path(scratch) / "figures.json")
            code = _bench(argparse.Namespace(**{**vars(args), "plot": None, "json": source}))
            document = json.loads(Path(source).read_text())
    else:
        document = json.loads(Path(source).read_text())
    directory = Path(args.plot)
    for path in plots.plot_figures(document, directory):
        print(f"wrote {path}")
    return code


def _demo(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from relay_tools import demo  # noqa: PLC0415
    from relay_tools.localservers import MissingServerBinary  # noqa: PLC0415

    setup_logging("warning", "text")
    try:
        return demo.main(environ, args.rate, args.seconds)
    except (MissingServerBinary, demo.DemoFailed) as exc:
        print(f"outbox-relay demo: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    if argv[:1] == ["bench"]:
        return _bench(build_parser().parse_args(argv))
    if argv[:1] == ["demo"]:
        return _demo(build_parser().parse_args(argv), environ)
    try:
        args, config = parse(argv, environ)
    except ConfigError as exc:
        print(f"outbox-relay: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    if args.command in ("install", "uninstall"):
        return _sql_command(args, config)
    if args.command in OPERATOR_COMMANDS:
        return _operator_command(args, config)
    commands = {"validate": _validate, "audit": _audit}
    command = commands.get(args.command)
    return command(args, config) if command is not None else app.run(config)


def entry() -> None:
    sys.exit(main())
