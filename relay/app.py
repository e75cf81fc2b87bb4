"""`outbox-relay run`: one trio nursery holding every task of the relay.

Tasks: the signal watcher, the metrics/health server, the NATS connector, the
LISTEN task, the fallback poll timer, the scheduler loop, the table gauges, the
poll of the table's writers (relay/writers.py), retention, the creation of a
partitioned table's partitions (relay/partitions.py), and the audit of the
streams (with --audit-interval). Shutdown goes through trio: SIGTERM or SIGINT
stops claiming, lets the batch in flight finish inside the publish timeout, then
cancels the rest.
"""

from __future__ import annotations

import functools
import logging
import signal

import trio

from relay import aio
from relay.audit import run_audits
from relay.backoff import ReconnectBackoff
from relay.batch import Batch
from relay.broker import Broker, nats_auth_options
from relay.config import Config, redact_nats_url, redact_url, show_duration
from relay.database import Database, connection_string
from relay.errors import BrokerUnavailable, ConfigError, DatabaseUnavailable, SetupError
from relay.failpoints import Failpoints
from relay.gauges import run_gauges
from relay.health import Health
from relay.httpserver import HttpServer, metrics_route
from relay.listen_connection import PostgresListenConnection
from relay.listener import Listener, server_idle_timeout
from relay.metrics import Metrics
from relay.partitions import run_partition_creation
from relay.retention import run_retention
from relay.retry import retry
from relay.scheduler import Scheduler
from relay.schemas import SchemaCheck, Schemas
from relay.streams import short_duplicate_windows
from relay.tracing import start_tracing
from relay.wakeup import Wakeup
from relay.writers import run_writer_polls

log = logging.getLogger(__name__)


class Relay:
    def __init__(self, config: Config, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.health = Health()
        self.wakeup = Wakeup()
        self.stopping = trio.Event()
        self.database = Database(config)
        self.broker = Broker(
            config.nats_urls,
            self._broker_changed,
            auth_options=nats_auth_options(config),
            publish_mode=config.publish_mode,
            on_modes_change=self.metrics.set_publish_modes,
            on_batch=lambda mode, outcome: self.metrics.batch_publishes.labels(mode, outcome).inc(),
        )
        self.listener = Listener(
            connect=functools.partial(
                PostgresListenConnection.connect,
                connection_string(config.session_database_url),
                self.database.names,
                # A statement unanswered this long means the connection is dead, even
                # if the kernel has not noticed (a path that drops packets sends no RST).
                min(5.0, config.listen_keepalive),
                server_idle_timeout(config.listen_keepalive),
            ),
            channel=config.channel,
            keepalive=config.listen_keepalive,
            wakeup=self.wakeup,
            health=self.health,
            metrics=self.metrics,
            self_check=functools.partial(self.database.notify, config.channel),
            on_checked=self._self_checked,
            poll_only="--poll-only" if config.poll_only else "",
        )
        self.schema_check = SchemaCheck(
            Schemas.load(config.schemas, required=config.schemas_required)
            if config.schemas
            else None,
            on_rejected=lambda event_type: self.metrics.schema_rejections.labels(
                event_type=self.metrics.event_type(event_type)
            ).inc(),
            on_unchecked=lambda event_type: self.metrics.schemaless_rows.labels(
                event_type=self.metrics.event_type(event_type)
            ).inc(),
        )
        self.tracing = start_tracing(row_spans=config.trace_rows)
        batch = Batch(
            config=config,
            database=self.database,
            broker=self.broker,
            failpoints=Failpoints(config.failpoints),
            schema_check=self.schema_check,
            tracing=self.tracing,
        )
        self.scheduler = Scheduler(
            config=config,
            run_batch=batch.run,
            broker=self.broker,
            metrics=self.metrics,
            health=self.health,
            wakeup=self.wakeup,
            listener=self.listener,
        )
        self._scheduler_started = False
        self._said_not_heard = False
        self._scheduler_done = trio.Event()
        self.metrics.ready.set_function(lambda: 0.0 if self.health.not_ready_reason() else 1.0)

    def _self_checked(self, heard: bool) -> None:
        """The LISTEN self-check's answer: on one URL for both, it also tells whether
        that URL is a transaction pooler (relay/poolers.py)."""
        self.database.learn_pooler(not heard)
        if heard or self._said_not_heard:
            return  # said once; the check is tried again every few minutes
        self._said_not_heard = True
        also = (
            " and, as --database-url is that pooler, preparing nothing and setting "
            "nothing beyond a transaction"
            if self.database.pooled and not self.config.listen_database_url
            else ""
        )
        log.warning(
            "the LISTEN connection hears no notification sent through another connection "
            "(most likely a transaction pooler, which gives each statement any server "
            "connection): running on the poll alone, new rows found every %s%s; for LISTEN "
            "latency give --listen-database-url a direct or session-mode URL, or say "
            "--poll-only to run without this check",
            show_duration(self.config.poll_interval),
            also,
        )

    def _broker_changed(self, connected: bool) -> None:
        self.health.broker = connected
        self.metrics.nats_connected.set(1 if connected else 0)
        if connected:
            self.wakeup.set("reconnect")

    def stop(self) -> None:
        self.stopping.set()
        self.health.stopping = True
        self.wakeup.set("stop")

    # -- health -----------------------------------------------------------------

    def liveness(self) -> tuple[int, str, bytes]:
        # Alive while the scheduler loop keeps turning: it wakes at least every poll
        # interval, and a batch never takes longer than the publish timeout.
        limit = max(30.0, 3 * self.config.poll_interval, 3 * self.config.publish_timeout)
        stalled = trio.current_time() - self.scheduler.heartbeat
        if stalled > limit:
            return 503, "text/plain", f"scheduler loop stalled for {stalled:.0f}s\n".encode()
        return 200, "text/plain", b"ok\n"

    def readiness(self) -> tuple[int, str, bytes]:
        reason = self.health.not_ready_reason()
        if reason:
            return 503, "text/plain", f"not ready: {reason}\n".encode()
        return 200, "text/plain", f"ready{self.health.ready_detail()}\n".encode()

    # -- tasks ------------------------------------------------------------------

    async def _watch_signals(self, cancel_scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    # Reread the schemas; a bad one is logged and the old set kept.
                    if not self.schema_check.reload():
                        log.info("SIGHUP received: no new schemas in force")
                    continue
                log.info("%s received: finishing the batch in flight", signal.Signals(signum).name)
                self.stop()
                break
        if self._scheduler_started:
            # The scheduler stops between batches; a batch ends within the publish
            # timeout. The margin covers its mark and commit.
            with trio.move_on_after(self.config.publish_timeout + 5.0):
                await self._scheduler_done.wait()
        cancel_scope.cancel()

    async def _connect_broker(self) -> None:
        await retry(
            self.broker.connect,
            # Only the server's unavailability is waited out; anything else is a bug,
            # and crashes the relay with its traceback for its supervisor to restart.
            failures=(BrokerUnavailable,),
            backoff=ReconnectBackoff(initial=0.2, cap=10.0),
        )
        await self._check_duplicate_windows()
        await self.broker.read_publish_modes()

    async def _check_duplicate_windows(self) -> None:
        """Warn about streams that forget a message id before a retried row comes back:
        a row whose ack was lost would be stored twice (consumers still dedupe on id)."""
        minimum = self.config.backoff_max + self.config.publish_timeout
        try:
            windows = await self.broker.duplicate_windows()
        except BrokerUnavailable as exc:
            log.warning("could not check the streams' duplicate windows: %s", exc)
            return
        short = short_duplicate_windows(windows, minimum)
        self.metrics.short_duplicate_windows.set(len(short))
        for name, window in short:
            log.warning(
                "stream %s keeps message ids for %s, less than --backoff-max + "
                "--publish-timeout (%s): a row retried after its ack was lost is stored "
                "twice; raise the stream's duplicate_window",
                name,
                show_duration(window),
                show_duration(minimum),
            )
        log.info(
            "checked the duplicate windows of %d streams: %d shorter than %s",
            len(windows),
            len(short),
            show_duration(minimum),
        )

    async def _poll(self) -> None:
        while True:
            await trio.sleep(self.config.poll_interval)
            self.wakeup.set("poll")

    async def _await_setup(self) -> bool:
        """Wait for the database, then check the table is installed. False means a
        setup problem that needs an operator (the relay exits)."""

        def database_down(_: BaseException) -> None:
            self.health.database = False

        try:
            report = await retry(
                self.database.check_setup,
                failures=(DatabaseUnavailable,),
                backoff=ReconnectBackoff(initial=0.2, cap=10.0),
                on_failure=database_down,
            )
        except SetupError as exc:
            self.health.setup_problem = str(exc)
            return False
        self.health.database = True
        if report.adopted_dead:
            log.warning(
                "%d rows of %s were at the attempt cap (%d) or dead without holding their "
                "subjects: marked dead now, holding back the later rows of their subjects "
                "(`outbox-relay status` lists them; `requeue` retries them, `skip` gives "
                "up on them)",
                report.adopted_dead,
                self.config.table_display,
                self.config.max_attempts,
            )
        if not report.trigger_present:
            log.warning(
                "notify trigger is not installed on %s: relying on the %.3gs poll only "
                "(run `outbox-relay install` for instant wake-ups)",
                self.config.table_display,
                self.config.poll_interval,
            )
        for problem in report.late_guard_problems:
            log.warning(
                "%s on %s: claims walk the claim index from its first entry while the "
                "late-row triggers do not fire ALWAYS, which costs more the longer "
                "something holds the vacuum horizon back (run `outbox-relay install`)",
                problem,
                self.config.table_display,
            )
        return True

    async def _run_scheduler(self) -> None:
        self._scheduler_started = True
        try:
            await self.scheduler.run(self.stopping)
        finally:
            self._scheduler_done.set()

    def _start_tasks(self, nursery: trio.Nursery) -> None:
        config = self.config
        nursery.start_soon(self._connect_broker)
        nursery.start_soon(self.listener.run)
        nursery.start_soon(self._poll)
        nursery.start_soon(run_gauges, config, self.database, self.metrics)
        nursery.start_soon(run_writer_polls, self.database, self.metrics)
        nursery.start_soon(run_retention, config, self.database, self.metrics)
        nursery.start_soon(run_partition_creation, config, self.database, self.metrics)
        if config.audit_interval:
            nursery.start_soon(run_audits, config, self.broker, self.metrics)
        nursery.start_soon(self._run_scheduler)

    async def run(
        self, *, task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until stopped. Raises SetupError if the table is not installed."""
        setup_ok = True
        config = self.config
        log.info(
            "starting: table %s, database %s, NATS %s",
            config.table_display,
            redact_url(config.database_url),
            ", ".join(redact_nats_url(u) for u in config.nats_urls),
        )
        self.metrics.up.set(1)
        async with aio.open_loop():
            await self.database.open()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_signals, nursery.cancel_scope)
                    port: int | None = None
                    if config.metrics_port:
                        server = HttpServer(
                            {
                                "/metrics": metrics_route(self.metrics.registry),
                                "/healthz": self.liveness,
                                "/readyz": self.readiness,
                            }
                        )
                        port = await nursery.start(
                            server.serve, config.metrics_host, config.metrics_port
                        )
                    task_status.started(port)
                    setup_ok = await self._await_setup()
                    if setup_ok:
                        self._start_tasks(nursery)
                    else:
                        nursery.cancel_scope.cancel()
            finally:
                self.metrics.up.set(0)
                with trio.CancelScope(shield=True):
                    await self.broker.close()
                    await self.database.close()
                    # Exports the spans still queued (bounded by the SDK's timeout).
                    await trio.to_thread.run_sync(self.tracing.shutdown)
        if not setup_ok:
            raise SetupError(self.health.setup_problem or "setup check failed")
        log.info("stopped")


def run(config: Config) -> int:
    """Run the relay in this process; the exit code for the command line."""

    async def main() -> None:
        await Relay(config).run()

    try:
        trio.run(main)
    except BaseException as exc:  # re-raised unless it is a start failure
        failure = start_failure(exc)
        if failure is None:
            raise
        log.error("cannot start: %s" if isinstance(failure, SetupError) else "%s", failure)
        return 2
    return 0


def start_failure(exc: BaseException) -> SetupError | ConfigError | None:
    """The setup or configuration error that stopped the start, alone or as the
    only kind of error in a nursery's exception group (a task found it); None for
    anything else, which is a crash."""
    if isinstance(exc, SetupError | ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found, rest = exc.split((SetupError, ConfigError))
        if found is not None and rest is None:
            return start_failure(found.exceptions[0])
    return None
