"""`outbox-relay bench --hostile`: rows and settings Postgres accepts that the
relay's model once did not (issue 39), one at a time beside steady load, on a
database whose defaults are `DateStyle 'SQL, DMY'` and `TimeZone 'Asia/Kolkata'`.

Each case writes its row, then a row of the same subject after it. It reports how
the row ended (published, or dead with its reason), how long after its writing was
done (the disabled trigger's: after it was enabled again, a second later), and
whether the row after it came after it; then the steady load's latency from commit
to consumer, and whether the relay stayed up throughout."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psycopg

from relay_tools.bench.harness import (
    INSERT,
    Consumer,
    RelayProcess,
    Target,
    bench_target,
    dumps,
    produce_at_rate,
    wait_until_ready,
)

TRACE_IDS = "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
DEEP = "[" * 3000 + "1" + "]" * 3000
SETTLE_LIMIT = 20.0  # seconds a case may take before it is reported as not settled


@dataclass(frozen=True)
class HostilePlan:
    rate: float = 200.0
    seconds: float = 60.0

    @classmethod
    def quick(cls) -> HostilePlan:
        return cls(rate=50.0, seconds=30.0)


@dataclass
class CaseResult:
    case: str
    outcome: str  # "published", "dead: <reason>", "not settled"
    seconds: float  # from its commit to published or dead
    in_order: bool | None  # the row after it came after it (None: none was written)
    envelope_keys_ok: bool = True  # nothing the producer wrote became an envelope key


@dataclass
class HostileReport:
    cases: list[CaseResult] = field(default_factory=list)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    events: int = 0
    relay_stayed_up: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    write: Callable[[Target, str, str], Awaitable[None]]  # (target, row id, subject)
    follow: bool = True  # a row of its subject after it (not for a row that goes dead)


async def _sql(target: Target, statement: str, params: tuple[object, ...] = ()) -> None:
    async with await psycopg.AsyncConnection.connect(target.url, autocommit=True) as conn:
        await conn.execute(statement, params)


_ROW = "insert into outbox_events (id, event_type, source, subject, time, data"


async def _null_seq(target: Target, row_id: str, subject: str) -> None:
    await _sql(
        target,
        _ROW + ", relay_seq) values (%s, %s, 'b', %s, now(), '{}', null)",
        (row_id, target.event_type, subject),
    )


async def _copy_null_seq(target: Target, row_id: str, subject: str) -> None:
    async with await psycopg.AsyncConnection.connect(target.url) as conn:
        cursor = conn.cursor()
        columns = "id, event_type, source, subject, time, data, relay_seq"
        async with cursor.copy(f"copy outbox_events ({columns}) from stdin") as copy:
            await copy.write_row(
                (row_id, target.event_type, "b", subject, "2026-12-05 00:00:00+00", "{}", None)
            )
        await conn.commit()


async def _replica_old(target: Target, row_id: str, subject: str) -> None:
    async with await psycopg.AsyncConnection.connect(target.url) as conn:
        await conn.execute("set local session_replication_role = replica")
        await conn.execute(
            _ROW + ", created_at) values (%s, %s, 'b', %s, now(), '{}', "
            "now() - interval '10 seconds')",
            (row_id, target.event_type, subject),
        )
        await conn.commit()


async def _old_created_at(target: Target, row_id: str, subject: str) -> None:
    await _sql(
        target,
        _ROW + ", created_at) values (%s, %s, 'b', %s, now(), '{}', now() - interval '10 s')",
        (row_id, target.event_type, subject),
    )


async def _put_back(target: Target, row_id: str, subject: str) -> None:
    await _sql(target, INSERT, (row_id, target.event_type, subject, "{}"))
    async with asyncio.timeout(10):
        while not await _settled(target, row_id):  # noqa: ASYNC110 - the table's state, polled
            await asyncio.sleep(0.01)
    await asyncio.sleep(2)  # the start keys pass it
    await _sql(target, "update outbox_events set published_at = null where id = %s", (row_id,))


async def _service_waits(target: Target, row_id: str, subject: str) -> None:
    await _sql(
        target,
        _ROW + ") values (%s, %s, 'b', %s, now(), '{\"wait\": 2}')",
        (row_id, target.event_type, subject),
    )


async def _triggers_off(target: Target, row_id: str, subject: str) -> None:
    await _sql(target, "alter table outbox_events disable trigger zz_outbox_events_relay_late")
    try:
        await _old_created_at(target, row_id, subject)
        await asyncio.sleep(1)
    finally:
        await _sql(
            target, "alter table outbox_events enable always trigger zz_outbox_events_relay_late"
        )


def _data(data: str, **columns: str) -> Callable[[Target, str, str], Awaitable[None]]:
    async def write(target: Target, row_id: str, subject: str) -> None:
        names = "".join(f", {name}" for name in columns)
        marks = ", %s" * len(columns)
        await _sql(
            target,
            _ROW + f"{names}) values (%s, %s, 'b', %s, now(), %s::jsonb{marks})",
            (row_id, target.event_type, subject, data, *columns.values()),
        )

    return write


CASES = [
    Case("an explicit null relay_seq", _null_seq),
    Case("a COPY with a null relay_seq", _copy_null_seq),
    Case("the replica role, created_at 10 s old", _replica_old),
    Case("an explicit created_at 10 s old", _old_created_at),
    Case("a row put back by hand", _put_back),
    Case("a service trigger that waits 2 s first", _service_waits),
    Case("the late trigger disabled, then enabled", _triggers_off),
    Case('data {"n": 1e400}, --schemas', _data('{"n": 1e400}')),
    Case("data 3,000 deep, --schemas", _data(DEEP), follow=False),
    Case("headers 3,000 deep", _data("{}", headers='{"h": ' + DEEP + "}"), follow=False),
    Case(
        "a traceparent tail with envelope keys",
        _data("{}", traceparent=f'01-{TRACE_IDS}-","admin":true,"x":"'),
    ),
    Case(
        "a header 1.2 MB in UTF-8 (600k characters)",
        _data("{}", headers=json.dumps({"x-wide": "é" * 600_000})),
        follow=False,
    ),
]


async def _settled(target: Target, row_id: str) -> str | None:
    """'published', 'dead: <error>', or None while neither."""
    async with await psycopg.AsyncConnection.connect(target.url) as conn:
        cursor = await conn.execute(
            "select published_at is not null, relay_dead_at is not null, relay_last_error "
            "from outbox_events where id = %s",
            (row_id,),
        )
        found = await cursor.fetchone()
    if found is None:
        return None
    published, dead, error = found
    if published:
        return "published"
    return f"dead: {error}" if dead else None


async def _run_case(case: Case, target: Target, consumer: Consumer) -> CaseResult:
    row_id, after = str(uuid.uuid4()), str(uuid.uuid4())
    subject = f"hostile-{uuid.uuid4().hex[:8]}"
    await case.write(target, row_id, subject)
    committed = time.perf_counter()
    if case.follow:
        await _sql(target, INSERT, (after, target.event_type, subject, "{}"))
    outcome = None
    deadline = committed + SETTLE_LIMIT
    while outcome is None and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
        outcome = await _settled(target, row_id)
    seconds = time.perf_counter() - committed
    in_order = None
    if case.follow:
        async with asyncio.timeout(SETTLE_LIMIT):
            while after not in consumer.order:  # noqa: ASYNC110 - arrivals come from a callback
                await asyncio.sleep(0.01)
        arrivals = [m for m in consumer.order if m in (row_id, after)]
        in_order = arrivals[:2] == [row_id, after] or (
            case.name == "a row put back by hand" and arrivals[-2:] == [row_id, after]
        )
    envelope = consumer.envelopes.get(row_id, {})
    keys_ok = not ({"admin", "x"} & envelope.keys())
    return CaseResult(case.name, outcome or "not settled", seconds, in_order, keys_ok)


async def measure_hostile(target: Target, plan: HostilePlan) -> HostileReport:
    name = target.database
    await target.execute(f"alter database \"{name}\" set datestyle = 'SQL, DMY'")
    await target.execute(f"alter database \"{name}\" set timezone = 'Asia/Kolkata'")
    await target.execute(
        """
        create or replace function zzz_service_lookup() returns trigger language plpgsql as $$
        begin
          perform pg_sleep((new.data->>'wait')::float8);
          return new;
        end $$;
        create trigger zzz_service_lookup before insert on outbox_events
          for each row when (new.data ? 'wait') execute function zzz_service_lookup();
        """
    )
    report = HostileReport()
    with tempfile.TemporaryDirectory() as schemas:
        schema = Path(schemas, f"{target.event_type}.schema.json")
        await asyncio.to_thread(schema.write_text, '{"type": "object"}')
        relay = RelayProcess(target.url, target.nats_url, schemas=schemas)
        async with (
            relay,
            Consumer(target.nats_url, f"{target.prefix}.>", keep_order=True) as steady,
        ):
            await wait_until_ready(target)

            async def inject() -> None:
                await asyncio.sleep(3)
                for case in CASES:
                    report.cases.append(await _run_case(case, target, steady))

            load = asyncio.create_task(
                produce_at_rate(target.url, target.event_type, plan.rate, plan.seconds)
            )
            await inject()
            committed = await load
            async with asyncio.timeout(30):
                await steady.wait_for(set(committed))
            assert relay.process is not None
            report.relay_stayed_up = relay.process.returncode is None
    latencies = sorted(steady.arrived[i] - at for i, at in committed.items())
    report.events = len(latencies)
    report.p50_ms = statistics.median(latencies) * 1000
    report.p99_ms = latencies[int(0.99 * (len(latencies) - 1))] * 1000
    return report


def render(report: HostileReport, plan: HostilePlan) -> str:
    lines = [
        f"each case beside {plan.rate:g} events/s for {plan.seconds:g} s, on a database "
        "whose defaults are DateStyle 'SQL, DMY' and TimeZone 'Asia/Kolkata':"
    ]
    for case in report.cases:
        order = {None: "", True: ", the next row of its subject after it"}.get(
            case.in_order, ", OUT OF ORDER"
        )
        keys = "" if case.envelope_keys_ok else ", A PRODUCER'S KEY IN THE ENVELOPE"
        lines.append(f"  {case.case}: {case.outcome[:90]} in {case.seconds:.2f} s{order}{keys}")
    lines.append(
        f"steady load: {report.events} events, p50 {report.p50_ms:.1f} ms, "
        f"p99 {report.p99_ms:.1f} ms from commit to consumer; the relay "
        + ("stayed up" if report.relay_stayed_up else "DID NOT STAY UP")
    )
    return "\n".join(lines) + "\n"


async def _main(database_url: str | None, nats_url: str | None, plan: HostilePlan) -> HostileReport:
    async with bench_target(database_url, nats_url) as target:
        return await measure_hostile(target, plan)


def main(
    database_url: str | None, nats_url: str | None, plan: HostilePlan, json_path: str | None
) -> int:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        report = runner.run(_main(database_url, nats_url, plan))
    print(render(report, plan), end="")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            out.write(dumps({"plan": asdict(plan), **asdict(report)}) + "\n")
    return 0
