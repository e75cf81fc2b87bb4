"""The configuration page's reference is the code's, word for word, and CI runs the
README's test command."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from relay.docs import alert_rules, alerts_table, metrics_table, options_table, with_tables

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def table(marker: str) -> str:
    text = CONFIGURATION.read_text()
    begin, end = f"<!-- {marker}:begin -->\n", f"\n<!-- {marker}:end -->"
    return text[text.index(begin) + len(begin) : text.index(end)]


def test_the_configuration_table_matches_the_code():
    assert table("options") == options_table(), "regenerate with: python -m relay.docs"


def test_the_metrics_table_matches_the_code():
    assert table("metrics") == metrics_table(), "regenerate with: python -m relay.docs"


def test_the_alerts_table_lists_every_alerting_rule():
    assert table("alerts") == alerts_table(alert_rules()), "regenerate with: python -m relay.docs"
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names)) == 17
    assert all(f"[{name}](runbooks.md#{name.lower()})" in table("alerts") for name in names)


def test_regenerating_the_tables_changes_nothing_else():
    text = CONFIGURATION.read_text()
    assert with_tables(text, alert_rules()) == text


def test_ci_runs_the_readme_test_command(tmp_path):
    # .ci/run with a stand-in `make` first on PATH: what CI actually invokes, against
    # the command the README's quick start gives for the whole suite.
    (tmp_path / "make").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    (tmp_path / "make").chmod(0o755)
    calls = tmp_path / "calls"
    result = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")],
        env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "CALLS": str(calls)},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    quick_start = README.read_text().split("## Quick start", 1)[1].split("```", 2)[1]
    [readme_command] = [
        line.split("#")[0].split()
        for line in quick_start.splitlines()
        if "whole test suite" in line
    ]
    assert " ".join(readme_command[1:]) in calls.read_text().splitlines()
    assert readme_command[0] == "make"
