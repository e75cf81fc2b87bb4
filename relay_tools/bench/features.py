"""`outbox-relay bench --features`: what the optional features cost the drain, on an
order-like payload (nested objects, an array, formats, enums):

- `--schemas`, with a schema that checks all of the payload, against the plain drain;
- rows that carry a trace context and two headers of their own, tracing off,
  against plain rows padded to the same message size (what is left is the relay's
  handling of them, not the bytes);
- the same traced rows with tracing on, exporting to an OTLP receiver on loopback,
  against tracing off: every producer sampled (a link a row), and one in ten.

Each drain gives its rate and the relay's CPU microseconds per row (all its threads:
the exporter's too). The arrangements alternate within every repetition."""

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


# What a traced producer adds to each row (relay/headers.py): its trace context,
# unique per row as a real one is, and two headers of its own; every trace sampled.
TRACED_COLUMNS = {
    "traceparent": "'00-' || md5(g::text) || '-' || left(md5((g + 1)::text), 16) || '-01'",
    "tracestate": "'shop=a' || g",
    "headers": """'{"x-tenant": "acme", "x-priority": "high"}'::jsonb""",
}
# The same with one producer trace in ten sampled (head sampling at 10%).
TENTH_SAMPLED_COLUMNS = {
    **TRACED_COLUMNS,
    "traceparent": "'00-' || md5(g::text) || '-' || left(md5((g + 1)::text), 16) || '-'"
    " || case when g %% 10 = 0 then '01' else '00' end",
}
# Plain rows whose message is as long as a traced row's: the envelope's extension
# attributes and the four headers come to about 230 bytes.
PADDED_DATA = ORDER_DATA[:-1] + ", 'pad', repeat('x', 220))"


@dataclass(frozen=True)
class Arrangement:
    key: str
    name: str
    schemas: bool = False  # --schemas with ORDER_SCHEMA
    columns: dict[str, str] | None = None
    data: str = ORDER_DATA
    tracing: dict[str, str] | None = None  # the SDK's variables beside the endpoint
    trace_rows: bool = False  # --trace-rows


ARRANGEMENTS = (
    Arrangement("without", "plain"),
    Arrangement("with_schemas", "with --schemas", schemas=True),
    Arrangement("padded", "plain rows padded to a traced row's message size", data=PADDED_DATA),
    Arrangement(
        "traced", "rows with trace context and two headers, tracing off", columns=TRACED_COLUMNS
    ),
    Arrangement(
        "tracing_on",
        "the same rows, tracing on, every producer sampled",
        columns=TRACED_COLUMNS,
        tracing={},
    ),
    Arrangement(
        "tracing_on_128_links",
        "the same, OTEL_SPAN_LINK_COUNT_LIMIT=128 (the SDK's default)",
        columns=TRACED_COLUMNS,
        tracing={"OTEL_SPAN_LINK_COUNT_LIMIT": "128"},
    ),
    Arrangement(
        "tracing_on_tenth",
        "the same rows, tracing on, one producer in ten sampled",
        columns=TENTH_SAMPLED_COLUMNS,
        tracing={},
    ),
    Arrangement(
        "trace_rows",
        "the same rows, tracing on with --trace-rows, every producer sampled",
        columns=TRACED_COLUMNS,
        tracing={},
        trace_rows=True,
    ),
    Arrangement(
        "trace_rows_tenth",
        "the same rows, tracing on with --trace-rows, one producer in ten sampled",
        columns=TENTH_SAMPLED_COLUMNS,
        tracing={},
        trace_rows=True,
    ),
)
# What each arrangement is measured against, and the least ratio it targets (None: a
# figure only, for a choice the operator makes: more links, or a span a row).
TARGETS: tuple[tuple[str, str, float | None], ...] = (
    ("with_schemas", "without", 0.9),
    ("traced", "padded", 0.95),
    ("tracing_on", "traced", 0.95),
    ("tracing_on_128_links", "traced", None),
    ("tracing_on_tenth", "traced", 0.95),
    ("trace_rows", "traced", None),
    ("trace_rows_tenth", "traced", None),
)


@dataclass(frozen=True)
class FeaturesPlan:
    repetitions: int = 5
    drain_rows: int = 50_000

    @classmethod
    def quick(cls) -> FeaturesPlan:
        return cls(repetitions=1, drain_rows=2_000)


@dataclass
class FeaturesReport:
    rates: dict[str, list[float]] = field(default_factory=dict)  # rows/s
    relay_us_per_row: dict[str, list[float]] = field(default_factory=dict)
    spans: int = 0  # exported with tracing on, and their links
    links: int = 0

    def ratios(self, key: str, against: str) -> list[float]:
        return [run / base for run, base in zip(self.rates[key], self.rates[against], strict=True)]


async def measure_features(target: Target, plan: FeaturesPlan) -> FeaturesReport:
    report = FeaturesReport()
    with (
        tempfile.TemporaryDirectory(prefix="outbox-relay-schemas-") as folder,
        OtlpSink(keep_spans=False) as sink,
    ):
        schema = Path(folder) / f"{target.event_type}.schema.json"
        schema.write_text(json.dumps(ORDER_SCHEMA))
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        for _ in range(plan.repetitions):
            for arrangement in ARRANGEMENTS:
                settings = {"schemas": folder} if arrangement.schemas else {}
                if arrangement.tracing is not None:
                    settings.update({**tracing, **arrangement.tracing})
                if arrangement.trace_rows:
                    settings["trace_rows"] = "true"
                await target.reset()
                drained = await measure.drain_cost(
                    target,
                    plan.drain_rows,
                    settings=settings,
                    data=arrangement.data,
                    columns=arrangement.columns,
                )
                report.rates.setdefault(arrangement.key, []).append(drained.rate)
                report.relay_us_per_row.setdefault(arrangement.key, []).append(
                    drained.relay_us_per_row
                )
                dead = await target.fetch_value(
                    "select count(*) from outbox_events where relay_dead_at is not null"
                )
                if dead:  # a row refused (the schema, its headers) would measure nothing
                    raise RuntimeError(f"{dead} rows went dead in the bench")
        report.spans, report.links = sink.span_count, sink.link_count
    if not report.spans:
        raise RuntimeError("tracing on exported no span")
    return report


def render(report: FeaturesReport, plan: FeaturesPlan) -> str:
    lines = [
        f"drain of {plan.drain_rows:,} order rows (nested objects, an array, formats, enums), "
        f"a transaction each; medians of {plan.repetitions}; relay CPU per row (all threads)",
    ]
    for arrangement in ARRANGEMENTS:
        rate = statistics.median(report.rates[arrangement.key])
        cpu = statistics.median(report.relay_us_per_row[arrangement.key])
        lines.append(f"  {arrangement.name}: {rate:,.0f} rows/s, relay {cpu:.1f} us/row")
    lines.append(
        f"  spans exported: {report.spans:,}, with {report.links:,} links "
        f"({report.links / max(report.spans, 1):.0f} a span)"
    )
    names = {arrangement.key: arrangement.name for arrangement in ARRANGEMENTS}
    verdicts = []
    for key, against, target in TARGETS:
        ratios = report.ratios(key, against)
        ratio = statistics.median(ratios)
        each = ", ".join(f"{r:.3f}" for r in ratios)
        cpu = statistics.median(report.relay_us_per_row[key]) - statistics.median(
            report.relay_us_per_row[against]
        )
        figure = f"{names[key]}: {ratio:.3f} x {names[against]} ({each}), relay {cpu:+.1f} us/row"
        if target is None:
            verdicts.append(f"  [figure] {figure}")
        else:
            verdict = "MET" if ratio >= target else "NOT MET"
            verdicts.append(f"  [{verdict}] {figure}; target at least {target:g} x")
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
                            key: {"against": against, "ratios": report.ratios(key, against)}
                            for key, against, _ in TARGETS
                        },
                    }
                )
            )
            out.write("\n")
    return 0
