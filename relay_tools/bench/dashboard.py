"""`outbox-relay bench --dashboard`: the dashboard (deploy/grafana/outbox-relay.json)
as it reads through a real run, for the docs.

Two relays run against throwaway Postgres and NATS JetStream servers on loopback, a
real Prometheus scrapes them every second, and producers commit events of three
types while things happen to the relays: a row whose subject no stream captures, a
row too large for the broker (it goes dead), and the broker down for a while and
back. Then every panel's own PromQL, exactly as the dashboard holds it, runs
against that Prometheus over the run (``query_range``, with ``$__rate_interval``
as Grafana would set it), and the answers are kept; ``--plot`` draws them on the
dashboard's grid (:func:`relay_tools.bench.plots.plot_dashboard`). Grafana itself
is not run here (its licence keeps it out of the project's tools): the picture is
the dashboard's queries and layout, drawn by matplotlib.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay_tools.bench.harness import (
    INSERT,
    RelayProcess,
    Target,
    produce_at_rate,
    provenance,
    wait_until_ready,
)
from relay_tools.localservers import (
    MissingServerBinary,
    ThrowawayNats,
    free_port,
    throwaway_nats,
    throwaway_postgres,
    wait_for_port,
)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "outbox-relay.json"
SCRAPE_SECONDS = 1
STEP_SECONDS = 2


@dataclass(frozen=True)
class DashboardPlan:
    """How long each part of the run lasts, and how fast producers commit."""

    steady: float = 60.0  # seconds of load before anything happens
    outage: float = 30.0  # the broker down
    recovery: float = 60.0  # the broker back, load as before
    # Events a second by type (each a suffix of the run's prefix).
    rates: tuple[tuple[str, float], ...] = (
        ("orders.placed", 150.0),
        ("payments.captured", 80.0),
        ("refunds.issued", 20.0),
    )
    replicas: int = 2

    @classmethod
    def quick(cls) -> DashboardPlan:
        return cls(steady=8.0, outage=6.0, recovery=8.0)

    @property
    def seconds(self) -> float:
        return self.steady + self.outage + self.recovery


@dataclass(frozen=True)
class Panel:
    """One panel of the dashboard: its title, unit, place on the grid (Grafana's 24
    columns) and its queries with their legends."""

    title: str
    unit: str
    x: int
    y: int
    w: int
    h: int
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend format)


def panels(dashboard: Mapping[str, Any]) -> list[Panel]:
    return [
        Panel(
            title=panel["title"],
            unit=panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short"),
            **{k: int(panel["gridPos"][k]) for k in ("x", "y", "w", "h")},
            targets=tuple((t["expr"], t.get("legendFormat", "")) for t in panel["targets"]),
        )
        for panel in dashboard["panels"]
    ]


def rate_interval(step: float, scrape: float) -> str:
    """Grafana's ``$__rate_interval``: the larger of four scrapes and a step plus one
    scrape, so that a rate always has two samples to work with."""
    return f"{math.ceil(max(4 * scrape, step + scrape))}s"


def expand(expr: str, interval: str) -> str:
    return expr.replace("$__rate_interval", interval)


_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name as Grafana writes it: the legend format with ``{{label}}``
    filled in, or the series' labels when the panel gives none."""
    if template:
        return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), template).strip()
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"


def series(answer: Mapping[str, Any], template: str, start: float) -> list[dict[str, Any]]:
    """A ``query_range`` answer as the chart's series: seconds since the run's start
    and values, NaN (a rate over no samples) kept as None."""
    out = []
    for result in answer["data"]["result"]:
        points = []
        for at, value in result["values"]:
            number = float(value)
            points.append([round(float(at) - start, 3), None if math.isnan(number) else number])
        out.append({"label": legend(template, result["metric"]), "points": points})
    return sorted(out, key=lambda s: str(s["label"]))


class Prometheus:
    """A throwaway Prometheus on loopback scraping ``targets`` (name: host:port)
    every SCRAPE_SECONDS."""

    def __init__(self, targets: Mapping[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-relay-prometheus-"))
        self.port = free_port()
        self.targets = dict(targets)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise MissingServerBinary(
                "prometheus is not installed (Debian: apt install prometheus)"
            )
        config = self.dir / "prometheus.yml"
        static = [
            {"targets": [address], "labels": {"instance": name}}
            for name, address in self.targets.items()
        ]
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": f"{SCRAPE_SECONDS}s"},
                    "scrape_configs": [{"job_name": "outbox-relay", "static_configs": static}],
                }
            )
        )
        with (self.dir / "prometheus.log").open("wb") as log:
            self.process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
            )  # fmt: skip
        wait_for_port(self.port, process=self.process)

    def get(self, path: str, **params: str | float) -> dict[str, Any]:
        query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as answer:
            document: dict[str, Any] = json.load(answer)
        return document

    def scraped_since(self, at: float) -> bool:
        """Whether every target has been scraped after ``at`` (Unix time)."""
        answer = self.get("/api/v1/query", query="timestamp(up)", time=time.time())
        results = answer["data"]["result"]
        return len(results) == len(self.targets) and all(float(r["value"][1]) > at for r in results)

    def destroy(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def throwaway_prometheus(targets: Mapping[str, str]) -> Iterator[Prometheus]:
    prometheus = Prometheus(targets)
    try:
        prometheus.start()
        yield prometheus
    finally:
        prometheus.destroy()


async def _incidents(
    target: Target, nats: ThrowawayNats, plan: DashboardPlan
) -> list[dict[str, Any]]:
    """What happens to the relays during the run, at its times; the phases, for the
    chart's shading."""
    started = time.time()
    await asyncio.sleep(plan.steady / 3)
    # An event type no stream captures: the row waits, and the relay says so (its
    # subject its own, so that it holds back no other row).
    await target.execute(
        INSERT, (str(uuid.uuid4()), f"unrouted{target.token}.created", "unrouted", '{"n": 1}')
    )
    await asyncio.sleep(plan.steady / 3)
    # A row over the broker's max_payload: its own fault, so it goes dead.
    await target.execute(
        INSERT,
        (str(uuid.uuid4()), f"{target.prefix}.orders.placed", "big", json.dumps("x" * 2_000_000)),
    )
    await asyncio.sleep(plan.steady / 3)
    down = time.time()
    await asyncio.to_thread(nats.kill)
    await asyncio.sleep(plan.outage)
    await asyncio.to_thread(nats.start)
    up = time.time()
    await asyncio.sleep(plan.recovery)
    return [
        {"name": "steady load", "start": 0.0, "end": down - started},
        {"name": "NATS down", "start": down - started, "end": up - started},
        {"name": "NATS back", "start": up - started, "end": time.time() - started},
    ]


async def _run(
    target: Target, nats: ThrowawayNats, plan: DashboardPlan
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ports = {f"relay-{i + 1}": free_port() for i in range(plan.replicas)}
    relays = [
        RelayProcess(target.url, target.nats_url, metrics_port=str(port), max_attempts="3",
                     backoff_base="1s", backoff_max="5s")
        for port in ports.values()
    ]  # fmt: skip
    with throwaway_prometheus({name: f"127.0.0.1:{p}" for name, p in ports.items()}) as prom:
        async with contextlib.AsyncExitStack() as stack:
            for relay in relays:
                await stack.enter_async_context(relay)
            await wait_until_ready(target)
            start = time.time()
            results = await asyncio.gather(
                _incidents(target, nats, plan),
                *(
                    produce_at_rate(
                        target.url, f"{target.prefix}.{suffix}", rate, plan.seconds, producers=2
                    )
                    for suffix, rate in plan.rates
                ),
            )
            end = time.time()
            async with asyncio.timeout(30):
                while not await asyncio.to_thread(prom.scraped_since, end):  # noqa: ASYNC110 - another process
                    await asyncio.sleep(0.2)
        return results[0], await asyncio.to_thread(_query, prom, start, end)


def _query(prom: Prometheus, start: float, end: float) -> list[dict[str, Any]]:
    interval = rate_interval(STEP_SECONDS, SCRAPE_SECONDS)
    drawn = []
    for panel in panels(json.loads(DASHBOARD.read_text())):
        lines = []
        for expr, template in panel.targets:
            answer = prom.get(
                "/api/v1/query_range", query=expand(expr, interval),
                start=start, end=end, step=STEP_SECONDS,
            )  # fmt: skip
            if answer.get("status") != "success":
                raise RuntimeError(f"Prometheus refused {expr!r}: {answer}")
            lines.extend(series(answer, template, start))
        drawn.append({**asdict(panel), "targets": [list(t) for t in panel.targets],
                      "series": lines})  # fmt: skip
    return drawn


async def _main(plan: DashboardPlan) -> dict[str, Any]:
    with throwaway_postgres(durable=True) as postgres, throwaway_nats() as nats:
        target = Target(postgres.url, nats.url)
        await target.create()
        phases, drawn = await _run(target, nats, plan)
    return {"plan": asdict(plan), "phases": phases, "panels": drawn}


def _lines(document: dict[str, Any]) -> str:
    """The document as JSON, each panel and each series of it on a line of its own."""
    board = document["dashboard"]
    lines = []
    for panel in board["panels"]:
        head = {k: v for k, v in panel.items() if k != "series"}
        series = ",\n".join("      " + json.dumps(s, sort_keys=True) for s in panel["series"])
        lines.append(f'    {json.dumps(head, sort_keys=True)[:-1]}, "series": [\n{series}\n    ]}}')
    rest = {k: v for k, v in board.items() if k != "panels"}
    return (
        f'{{"run": {json.dumps(document["run"], sort_keys=True)},\n "dashboard": '
        f'{json.dumps(rest, sort_keys=True)[:-1]}, "panels": [\n' + ",\n".join(lines) + "\n  ]}}"
    )


def main(plan: DashboardPlan, json_path: str | None) -> int:
    run = provenance()
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        document = {"run": run, "dashboard": runner.run(_main(plan))}
    empty = [p["title"] for p in document["dashboard"]["panels"] if not p["series"]]
    for panel in document["dashboard"]["panels"]:
        print(f"{panel['title']}: {len(panel['series'])} series")
    if empty:
        print(f"panels with no series in this run: {', '.join(empty)}")
    if json_path:
        # One series to a line: thousands of points, each of them a line, made the
        # committed figures ten thousand lines long.
        Path(json_path).write_text(_lines(document) + "\n")
    return 0
