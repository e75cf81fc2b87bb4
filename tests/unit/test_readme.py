"""The README's configuration reference is the code's, word for word."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from relay.docs import metrics_table, options_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_matches_the_code():
    text = README.read_text()
    begin, end = "<!-- options:begin -->\n", "\n<!-- options:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == options_table(), "regenerate with: python -m relay.docs"


def test_readme_metrics_table_matches_the_code():
    text = README.read_text()
    begin, end = "<!-- metrics:begin -->\n", "\n<!-- metrics:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == metrics_table(), "regenerate with: python -m relay.docs"


def test_ci_runs_the_readme_test_command(tmp_path):
    # .ci/run with a stand-in `make` first on PATH: what CI actually invokes, against
    # the command the README's quick start gives for the whole suite.
    (tmp_path / "make").write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n')
    (tmp_path / "make").chmod(0o755)
    calls = tmp_path / "calls"
    result = subprocess.run(
        ["bash", str(README.parent / ".ci" / "run")],
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
    assert calls.read_text().splitlines() == [" ".join(readme_command[1:])]
    assert readme_command[0] == "make"
