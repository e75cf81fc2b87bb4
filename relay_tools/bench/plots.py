"""`outbox-relay bench --plot DIR`: PNG charts of a bench run's figures (the JSON that
`--json` writes), for the docs' performance page. matplotlib comes with the `bench`
extra (`pip install 'outbox-relay[bench]'`).

- `drain.png`: drain rate by backlog shape and by publish mode (median, min-max);
- `latency.png`: commit-to-consumer p50 and p99 by load;
- `soak.png` (from `--soak`): p50 and p99 per window, the hold shaded, and the
  table's dead tuples;
- `soak-start-key.png` (from `--soak --without-start-key`): p99 per window through the
  hold, claims from the start key against claims from the claim index's first entry;
- `dashboard.png` (from `--dashboard`): the Grafana dashboard's panels, on its grid,
  as their queries answered through a real run.

Every axis starts at zero, and every chart's caption names the command, machine,
date and build of the run its figures come from (the document's ``run``). The
chart's PNG metadata carries the SHA-256 of the figures it was drawn from
(``figures_digest``), so a test can tell a chart from figures other than those
committed beside it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

DRAIN_SHAPES = (
    ("drain_rate", "a transaction each"),
    ("drain_bulk_rate", "one transaction"),
    ("drain_dead_ahead_rate", "behind dead rows"),
    ("drain_replicas_rate", "several relays"),
    ("drain_mode_message_rate", "--publish-mode message"),
    ("drain_mode_batch_rate", "--publish-mode batch"),
    ("drain_mode_atomic_rate", "--publish-mode atomic"),
)
_LATENCY = re.compile(r"relay_latency_([0-9.]+)_(p50|p99)$")


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - optional: the bench extra

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(
            "outbox-relay bench --plot needs matplotlib: pip install 'outbox-relay[bench]'"
        ) from exc
    return plt


def figures_digest(document: dict[str, Any]) -> str:
    """The SHA-256 of a run's figures, as a chart's metadata carries it."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def caption(document: dict[str, Any]) -> str:
    run = document.get("run")
    if not run:
        return "measured by a run that did not record its command, machine or date"
    return f"{run['command']}\n{run['machine']}, {run['date']}, build {run['build']}"


def plot_figures(document: dict[str, Any], directory: Path) -> list[Path]:
    """The charts of any run's figures: the dashboard's, a soak's or the bench's."""
    if "dashboard" in document:
        return plot_dashboard(document, directory)
    if "windows" in document:
        return plot_soak(document, directory)
    return plot_bench(document, directory)


def plot_bench(document: dict[str, Any], directory: Path) -> list[Path]:
    """The charts of a bench run (`outbox-relay bench --json`)."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    figures = document["figures"]
    written = []
    shapes = [(key, label) for key, label in DRAIN_SHAPES if key in figures]
    if shapes:
        fig, ax = plt.subplots(figsize=(8, 4.6))
        medians = [figures[key]["median"] for key, _ in shapes]
        errors = [
            [m - figures[key]["min"] for (key, _), m in zip(shapes, medians, strict=True)],
            [figures[key]["max"] - m for (key, _), m in zip(shapes, medians, strict=True)],
        ]
        ax.barh([label for _, label in shapes], medians, xerr=errors, color="#3b7dd8")
        ax.invert_yaxis()
        ax.set_xlabel("rows drained per second (median; bars: min-max)")
        ax.set_xlim(left=0)
        ax.set_title("Drain of a committed backlog")
        written.append(_save(fig, directory / "drain.png", plt, document))
    latency: dict[float, dict[str, float]] = {}
    for key, figure in figures.items():
        found = _LATENCY.match(key)
        if found:
            latency.setdefault(float(found.group(1)), {})[found.group(2)] = figure["median"]
    if latency:
        rates = sorted(latency)
        fig, ax = plt.subplots(figsize=(8, 4.6))
        positions = range(len(rates))
        for offset, (percentile, color) in enumerate((("p50", "#3b7dd8"), ("p99", "#d8843b"))):
            ax.bar(
                [p + (offset - 0.5) * 0.4 for p in positions],
                [latency[rate].get(percentile, 0.0) for rate in rates],
                width=0.4,
                label=percentile,
                color=color,
            )
        ax.set_xticks(list(positions), [f"{rate:g}/s" for rate in rates])
        ax.set_xlabel("offered load, events per second")
        ax.set_ylabel("ms, commit to consumer (median of runs)")
        ax.set_ylim(bottom=0)
        ax.set_title("Latency by load")
        ax.legend()
        written.append(_save(fig, directory / "latency.png", plt, document))
    return written


def plot_soak(document: dict[str, Any], directory: Path) -> list[Path]:
    """The chart of a soak (`outbox-relay bench --soak --json`)."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    windows = document["windows"]
    minutes = [w["start"] / 60 for w in windows]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = (minutes[1] - minutes[0]) if len(minutes) > 1 else 1.0
    for window, start in zip(windows, minutes, strict=True):
        if window["held"]:
            ax.axvspan(start, start + width, color="#eeeeee")
    ax.plot(minutes, [w["p50_ms"] for w in windows], marker="o", label="p50", color="#3b7dd8")
    ax.plot(minutes, [w["p99_ms"] for w in windows], marker="o", label="p99", color="#d8843b")
    ax.set_xlabel("minutes since the start (grey: the vacuum horizon held)")
    ax.set_ylabel("ms, commit to consumer, per window")
    ax.set_ylim(bottom=0)
    tuples = ax.twinx()
    tuples.plot(
        minutes, [w["dead_tuples"] for w in windows], linestyle="--", color="#777777",
        label="dead tuples",
    )  # fmt: skip
    tuples.set_ylabel("dead tuples in the outbox table")
    tuples.set_ylim(bottom=0)
    lines = ax.get_lines() + tuples.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper left")
    ax.set_title("Latency while something holds the vacuum horizon")
    written = [_save(fig, directory / "soak.png", plt, document)]
    if "without_start_key" in document:
        written.append(_plot_start_key(document, directory, plt))
    return written


def _plot_start_key(document: dict[str, Any], directory: Path, plt: Any) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.6))
    runs = (
        (document, "from the start key", "#3b7dd8"),
        (document["without_start_key"], "from the claim index's first entry", "#d8843b"),
    )
    windows = document["windows"]
    width = windows[1]["start"] - windows[0]["start"] if len(windows) > 1 else 60.0
    for window in windows:
        if window["held"]:
            ax.axvspan(window["start"] / 60, (window["start"] + width) / 60, color="#eeeeee")
    for run, label, color in runs:
        minutes = [w["start"] / 60 for w in run["windows"]]
        ax.plot(minutes, [w["p99_ms"] for w in run["windows"]], marker="o", label=label,
                color=color)  # fmt: skip
    ax.set_xlabel("minutes since the start (grey: the vacuum horizon held)")
    ax.set_ylabel("ms, commit to consumer, p99 per window")
    ax.set_ylim(bottom=0)
    ax.legend(title="claims walk", loc="upper left")
    ax.set_title("p99 through a held horizon: where the claim starts")
    return _save(fig, directory / "soak-start-key.png", plt, document)


# Shading of the dashboard run's phases (the steady load goes unshaded).
PHASE_COLOURS = {"NATS down": "#f6d5d5", "NATS back": "#e4efe0"}
UNIT_LABELS = {"ops": "per second", "s": "seconds", "short": "count"}


def plot_dashboard(document: dict[str, Any], directory: Path) -> list[Path]:
    """The dashboard's panels through a run (`outbox-relay bench --dashboard --json`),
    each where the dashboard's grid puts it (24 columns; rows of 8 units)."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    run = document["dashboard"]
    panels = run["panels"]
    rows = max((p["y"] + p["h"]) for p in panels) // 8
    fig, grid = plt.subplots(rows, 2, figsize=(15, 3.1 * rows), squeeze=False)
    for panel in panels:
        ax = grid[panel["y"] // 8][min(1, panel["x"] // 12)]
        for phase in run["phases"]:
            if phase["name"] in PHASE_COLOURS:
                ax.axvspan(phase["start"] / 60, phase["end"] / 60,
                           color=PHASE_COLOURS[phase["name"]])  # fmt: skip
        for line in panel["series"]:
            minutes = [at / 60 for at, _ in line["points"]]
            values = [math.nan if v is None else v for _, v in line["points"]]
            ax.plot(minutes, values, label=line["label"], linewidth=1.2)
        if not panel["series"]:
            ax.text(0.5, 0.5, "no data in this run", transform=ax.transAxes, ha="center",
                    color="#777777")  # fmt: skip
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel(UNIT_LABELS.get(panel["unit"], panel["unit"]), fontsize=8)
        ax.set_xlabel("minutes since the start", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, run["phases"][-1]["end"] / 60)
        ax.tick_params(labelsize=7)
        if panel["series"]:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle(
        "The dashboard in deploy/grafana through a run of two relays: "
        "shaded red while NATS was down, green once it was back",
        fontsize=12,
    )
    return [_save(fig, directory / "dashboard.png", plt, document, margins=(0.025, 0.975))]


def _save(
    fig: Any,
    path: Path,
    plt: Any,
    document: dict[str, Any],
    margins: tuple[float, float] = (0.08, 1.0),
) -> Path:
    """``margins``: the figure's fraction below the charts (the caption's) and its top."""
    fig.text(0.01, 0.01, caption(document), fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, margins[0], 1, margins[1]))
    fig.savefig(path, dpi=110, metadata={"Description": figures_digest(document)})
    plt.close(fig)
    return path
