"""`outbox-relay bench --validation`: the drain with `--schemas` against the drain
without, on an order-like payload (nested objects, an array, formats, enums) and a
schema that checks all of it. The two alternate within every repetition."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay_tools.bench import measure
from relay_tools.bench.harness import Target, bench_servers, dumps

# Each row's data, from the series number g: about 400 bytes of JSON (SQL sent with
# parameters, so its modulo signs are doubled).
ORDER_DATA = """jsonb_build_object(
    'order_id', gen_random_uuid(),
    'status', (array['created', 'paid', 'shipped'])[1 + g %% 3],
    'customer', jsonb_build_object('id', 'c' || g, 'email', 'c' || g || '@example.com',
                                   'country', 'DE'),
    'amount', jsonb_build_object('value', (g %% 10000) / 100.0, 'currency', 'EUR'),
    'lines', jsonb_build_array(jsonb_build_object('sku', 'sku-' || g %% 50, 'qty', 1 + g %% 3),
                               jsonb_build_object('sku', 'sku-7', 'qty', 1)),
    'placed_at', to_char(now() at time zone 'utc', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))"""

ORDER_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["order_id", "status", "customer", "amount", "lines", "placed_at"],
    "additionalProperties": False,
    "properties": {
        "order_id": {"type": "string", "format": "uuid"},
        "status": {"enum": ["created", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "required": ["id", "email"],
            "properties": {
                "id": {"type": "string", "minLength": 1},
                "email": {"type": "string", "format": "email"},
                "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
        },
        "amount": {
            "type": "object",
            "required": ["value", "currency"],
            "properties": {
                "value": {"type": "number", "minimum": 0},
                "currency": {"enum": ["EUR", "USD", "GBP"]},
            },
        },
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["sku", "qty"],
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                },
            },
        },
        "placed_at": {"type": "string", "format": "date-time"},
    },
}


@dataclass(frozen=True)
class ValidationPlan:
    repetitions: int = 5
    drain_rows: int = 50_000

    @classmethod
    def quick(cls) -> ValidationPlan:
        return cls(repetitions=1, drain_rows=2_000)


@dataclass
class ValidationReport:
    without: list[float] = field(default_factory=list)  # rows/s
    with_schemas: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [w / o for w, o in zip(self.with_schemas, self.without, strict=True)]


async def measure_validation(target: Target, plan: ValidationPlan) -> ValidationReport:
    report = ValidationReport()
    with tempfile.TemporaryDirectory(prefix="outbox-relay-schemas-") as folder:
        schema = Path(folder) / f"{target.event_type}.schema.json"
        schema.write_text(json.dumps(ORDER_SCHEMA))
        for _ in range(plan.repetitions):
            for settings, into in (
                ({}, report.without),
                ({"schemas": folder}, report.with_schemas),
            ):
                await target.reset()
                into.append(
                    await measure.drain_rate(
                        target, plan.drain_rows, settings=settings, data=ORDER_DATA
                    )
                )
                dead = await target.fetch_value(
                    "select count(*) from outbox_events where relay_dead_at is not null"
                )
                if dead:  # a schema that refuses the payload would measure nothing
                    raise RuntimeError(f"{dead} rows failed the bench's own schema")
    return report


def render(report: ValidationReport, plan: ValidationPlan) -> str:
    ratio = statistics.median(report.ratios)
    return (
        f"drain of {plan.drain_rows:,} order rows (nested objects, an array, formats, enums), "
        f"a transaction each; medians of {plan.repetitions}\n"
        f"  without --schemas: {statistics.median(report.without):,.0f} rows/s\n"
        f"  with --schemas:    {statistics.median(report.with_schemas):,.0f} rows/s\n"
        f"  ratio: {ratio:.3f} (each repetition: "
        + ", ".join(f"{r:.3f}" for r in report.ratios)
        + ")\n"
        f"targets:\n  [{'MET' if ratio >= 0.9 else 'NOT MET'}] with --schemas within 10% of "
        "the drain without\n"
    )


async def _main(
    database_url: str | None, nats_url: str | None, plan: ValidationPlan
) -> ValidationReport:
    with bench_servers(database_url, nats_url) as (pg, nats_url_):
        target = Target(pg, nats_url_)
        await target.create()
        try:
            return await measure_validation(target, plan)
        finally:
            await target.drop()


def main(
    database_url: str | None, nats_url: str | None, plan: ValidationPlan, json_path: str | None
) -> int:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        report = runner.run(_main(database_url, nats_url, plan))
    print(render(report, plan), end="")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            out.write(dumps({"plan": asdict(plan), **asdict(report), "ratios": report.ratios}))
            out.write("\n")
    return 0
