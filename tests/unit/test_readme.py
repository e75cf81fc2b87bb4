"""The README's configuration reference is the code's, word for word."""

from __future__ import annotations

from pathlib import Path

from relay.docs import options_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_matches_the_code():
    text = README.read_text()
    begin, end = "<!-- options:begin -->\n", "\n<!-- options:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == options_table(), "regenerate with: python -m relay.docs"


def test_readme_names_the_test_command_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in README.read_text()
    assert "make test" in ci
