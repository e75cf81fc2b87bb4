"""`outbox-relay bench --features`: what the optional features cost the drain, on an
order-like payload (nested objects, an array, formats, enums), each against the
plain drain of the same rows:

- `--schemas`, with a schema that checks all of the payload;
- rows that carry a trace context and two headers of their own, tracing off;
- the same rows with tracing on, exporting to an OTLP receiver on loopback.

The arrangements alternate within every repetition."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay_tools.bench import measure
from relay_tools.bench.harness import Target, bench_target, dumps
from relay_tools.otlpsink import OtlpSink

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
class FeaturesPlan:
    repetitions: int = 5
    drain_rows: int = 50_000

    @classmethod
    def quick(cls) -> FeaturesPlan:
        return cls(repetitions=1, drain_rows=2_000)


# What a traced producer adds to each row (relay/headers.py): its trace context,
# unique per row as a real one is, and two headers of its own.
TRACED_COLUMNS = {
    "traceparent": "'00-' || md5(g::text) || '-' || left(md5((g + 1)::text), 16) || '-01'",
    "tracestate": "'shop=a' || g",
    "headers": """'{"x-tenant": "acme", "x-priority": "high"}'::jsonb""",
}


@dataclass
class FeaturesReport:
    without: list[float] = field(default_factory=list)  # rows/s
    with_schemas: list[float] = field(default_factory=list)
    traced: list[float] = field(default_factory=list)  # rows with trace context, headers
    tracing_on: list[float] = field(default_factory=list)  # the same, spans exported

    def ratios(self, runs: list[float]) -> list[float]:
        return [run / plain for run, plain in zip(runs, self.without, strict=True)]


async def measure_features(target: Target, plan: FeaturesPlan) -> FeaturesReport:
    report = FeaturesReport()
    with (
        tempfile.TemporaryDirectory(prefix="outbox-relay-schemas-") as folder,
        OtlpSink() as sink,
    ):
        schema = Path(folder) / f"{target.event_type}.schema.json"
        schema.write_text(json.dumps(ORDER_SCHEMA))
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        for _ in range(plan.repetitions):
            for settings, columns, into in (
                ({}, None, report.without),
                ({"schemas": folder}, None, report.with_schemas),
                ({}, TRACED_COLUMNS, report.traced),
                (tracing, TRACED_COLUMNS, report.tracing_on),
            ):
                await target.reset()
                into.append(
                    await measure.drain_rate(
                        target,
                        plan.drain_rows,
                        settings=settings,
                        data=ORDER_DATA,
                        columns=columns,
                    )
                )
                dead = await target.fetch_value(
                    "select count(*) from outbox_events where relay_dead_at is not null"
                )
                if dead:  # a row refused (the schema, its headers) would measure nothing
                    raise RuntimeError(f"{dead} rows went dead in the bench")
        if not sink.spans:
            raise RuntimeError("tracing on exported no span")
    return report


# Each arrangement against the plain drain: its name, and the least ratio it targets.
TARGETS = (
    ("with_schemas", "with --schemas", 0.9),
    ("traced", "rows with trace context and two headers, tracing off", 0.95),
    ("tracing_on", "the same rows, tracing on (spans exported over OTLP)", 0.95),
)


def render(report: FeaturesReport, plan: FeaturesPlan) -> str:
    lines = [
        f"drain of {plan.drain_rows:,} order rows (nested objects, an array, formats, enums), "
        f"a transaction each; medians of {plan.repetitions}",
        f"  plain: {statistics.median(report.without):,.0f} rows/s",
    ]
    verdicts = []
    for key, name, target in TARGETS:
        runs = getattr(report, key)
        ratios = report.ratios(runs)
        ratio = statistics.median(ratios)
        each = ", ".join(f"{r:.3f}" for r in ratios)
        lines.append(f"  {name}: {statistics.median(runs):,.0f} rows/s, ratio {ratio:.3f} ({each})")
        verdicts.append(
            f"  [{'MET' if ratio >= target else 'NOT MET'}] {name}: at least {target:g} x plain"
        )
    return "\n".join([*lines, "targets:", *verdicts]) + "\n"


async def _main(
    database_url: str | None, nats_url: str | None, plan: FeaturesPlan
) -> FeaturesReport:
    async with bench_target(database_url, nats_url) as target:
        return await measure_features(target, plan)


def main(
    database_url: str | None, nats_url: str | None, plan: FeaturesPlan, json_path: str | None
) -> int:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        report = runner.run(_main(database_url, nats_url, plan))
    print(render(report, plan), end="")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as out:
            out.write(
                dumps(
                    {
                        "plan": asdict(plan),
                        **asdict(report),
                        "ratios": {
                            key: report.ratios(getattr(report, key)) for key, _, _ in TARGETS
                        },
                    }
                )
            )
            out.write("\n")
    return 0
