"""Every table or block of measured figures in docs/ says how, where and when it was
measured: a bench command, the machine and a date, in the block or in the 40 lines
before it (the paragraph that introduces it, or its section's opening)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A figure with its unit; a block with fewer than three is not a table of figures
# (a configuration table, the alerts, the guarantees).
FIGURE = re.compile(r"\d[\d,.]*\s?(ms|rows/s|msgs/s|µs|us|MB|MiB|commits/s|events/s|B)\b")
COMMAND = re.compile(r"outbox-relay bench|relay_tools\.bench|pgbench|py-spy|make bench")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"2 cores|2-core|this machine|project's machine|same machine", re.I)
CONTEXT_LINES = 40


def blocks(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(first, last) line indexes of each fenced block and each table."""
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = i + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            yield i, end
            i = end + 1
        elif lines[i].startswith("|"):
            end = i
            while end + 1 < len(lines) and lines[end + 1].startswith("|"):
                end += 1
            yield i, end
            i = end + 1
        else:
            i += 1


def unsourced(text: str) -> list[str]:
    """Each block of figures without a command, a machine or a date near it."""
    lines = text.split("\n")
    found = []
    for first, last in blocks(lines):
        if len(FIGURE.findall("\n".join(lines[first : last + 1]))) < 3:
            continue
        context = "\n".join(lines[max(0, first - CONTEXT_LINES) : last + 1])
        missing = [
            name
            for name, pattern in (("command", COMMAND), ("machine", MACHINE), ("date", DATE))
            if not pattern.search(context)
        ]
        if missing:
            found.append(f"line {first + 1}: no {', '.join(missing)}: {lines[first][:60]}")
    return found


def test_a_table_of_figures_without_its_date_is_found():
    page = "intro\n\n| rate | p99 |\n| --- | --- |\n| 100/s | 4 ms |\n| 1,000/s | 9 ms |\n"
    page += "| 3,000/s | 30 ms |\n"
    assert unsourced(page) == ["line 3: no command, machine, date: | rate | p99 |"]
    sourced = "`outbox-relay bench steady`, this machine, 2026-12-07:\n\n" + page
    assert unsourced(sourced) == []


def test_a_table_without_figures_needs_no_source():
    assert unsourced("| option | default |\n| --- | --- |\n| `--poll` | 1 s |\n") == []


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_figure_in_the_docs_names_its_command_machine_and_date(page):
    assert unsourced(page.read_text()) == []
