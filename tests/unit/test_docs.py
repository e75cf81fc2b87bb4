"""The documentation site builds with --strict, every alert links to its runbook
section, every runbook section belongs to an alert and says what not to do, when to
escalate, what to collect and what it protects, and each link's anchor exists in
the built site."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_URL = "{{ $externalLabels.relay_docs_url }}/runbooks/#"


def alerts() -> dict[str, dict[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return {rule["alert"]: rule["annotations"] for rule in rules}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    built = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return built


def test_every_alert_has_a_runbook_section_and_every_section_an_alert():
    sections = set(re.findall(r"^## (\w+)$", RUNBOOKS.read_text(), re.MULTILINE))
    assert sections == set(alerts())


def runbook_sections() -> dict[str, str]:
    parts = re.split(r"^## (\w+)\n", RUNBOOKS.read_text(), flags=re.MULTILINE)[1:]
    return dict(zip(parts[::2], parts[1::2], strict=True))


@pytest.mark.parametrize("block", ["**Don't.**", "**Escalate when**", "**Collect**"])
def test_every_runbook_says_what_not_to_do_when_to_escalate_and_what_to_collect(block):
    missing = [name for name, text in runbook_sections().items() if block not in text]
    assert not missing, f"runbooks without {block}: {missing}"


def test_every_runbook_links_its_guarantee_a_setting_and_the_metrics_its_alert_reads():
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    for rule in rules:
        text = " ".join(runbook_sections()[rule["alert"]].split())
        assert "**Protects** [" in text, rule["alert"]
        assert "](guarantees.md#" in text, rule["alert"]
        assert "](configuration.md#option-" in text, rule["alert"]
        for metric in set(re.findall(r"outbox_relay_\w+", str(rule["expr"]))):
            assert f"](configuration.md#{metric})" in text, (rule["alert"], metric)


def test_every_runbook_url_points_at_its_alerts_section(site):
    page = (site / "runbooks" / "index.html").read_text()
    anchors = set(re.findall(r'\bid="([^"]+)"', page))
    for alert, notes in alerts().items():
        url = notes.get("runbook_url", "")
        assert url.startswith(RUNBOOK_URL), (alert, url)
        anchor = url[len(RUNBOOK_URL) :]
        assert anchor == alert.lower(), (alert, anchor)
        assert anchor in anchors, f"{alert}: #{anchor} is not in the built runbooks page"


def test_the_event_path_diagram_is_rendered_by_the_site(site):
    page = (site / "how-it-works" / "index.html").read_text()
    assert '<pre class="mermaid">' in page
    assert "sequenceDiagram" in page
