"""The docs' charts (docs/img) are drawn from the figures committed beside them, by
a run that recorded its command, machine, date and build (a commit of this
checkout's history), and drawing them again from those figures gives the same
charts' metadata."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from relay_tools.bench import plots

IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
# Each chart, and the run's figures it is drawn from (`outbox-relay bench --plot
# docs/img --json docs/img/<figures>`).
CHARTS = {
    "drain.png": "bench.json",
    "latency.png": "bench.json",
    "soak.png": "soak.json",
    "soak-start-key.png": "soak.json",
    "dashboard.png": "dashboard.json",
}
# The bench mode each figures file comes from.
MODES = {"bench.json": "", "soak.json": " --soak", "dashboard.json": " --dashboard"}


def figures(name: str) -> dict:
    return json.loads((IMG / name).read_text())


def digest_in(chart: Path) -> str:
    with Image.open(chart) as image:
        return str(image.info.get("Description", ""))


@pytest.mark.parametrize(("chart", "source"), CHARTS.items())
def test_each_chart_is_drawn_from_the_figures_committed_beside_it(chart, source):
    document = figures(source)
    assert digest_in(IMG / chart) == plots.figures_digest(document), (
        f"docs/img/{chart} was not drawn from docs/img/{source}: run "
        f"`outbox-relay bench{MODES[source]} "
        f"--plot docs/img --json docs/img/{source}`"
    )


@pytest.mark.parametrize("source", sorted(set(CHARTS.values())))
def test_each_run_recorded_its_command_machine_date_and_build(source):
    run = figures(source)["run"]
    assert run["command"].startswith("outbox-relay bench")
    assert f"--json docs/img/{source}" in run["command"]
    assert run["machine"]
    assert run["date"]
    assert not run["build"].endswith("+changes"), "a chart of code no commit holds"
    assert run["build"] in plots.caption(figures(source))


@pytest.mark.parametrize("source", sorted(set(CHARTS.values())))
def test_the_charts_are_drawn_again_from_their_figures(source, tmp_path):
    document = figures(source)
    drawn = plots.plot_figures(document, tmp_path)
    assert {path.name for path in drawn} == {c for c, s in CHARTS.items() if s == source}
    for path in drawn:
        assert digest_in(path) == plots.figures_digest(document)


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=IMG.parents[1], capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("source", sorted(set(CHARTS.values())))
def test_each_run_measured_a_commit_this_checkout_holds(source):
    """A chart of a scratch branch that never landed would pass for this code's."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    shallow = git("rev-parse", "--is-shallow-repository")
    if shallow.returncode != 0:
        pytest.skip("not a git checkout")
    if shallow.stdout.strip() != "false":
        pytest.skip("a shallow clone holds too little history to tell")
    build = figures(source)["run"]["build"]
    ancestor = git("merge-base", "--is-ancestor", build, "HEAD")
    assert ancestor.returncode == 0, (
        f"docs/img/{source} was measured at {build}, which is not in this checkout's "
        f"history: {ancestor.stderr.strip()}"
    )
