"""The configuration page's options and metrics tables (docs/configuration.md),
generated from the options and from relay/metrics.toml.

``python -m relay.docs`` writes both into the page between their markers; a test
checks the page carries them as they are.
"""

from __future__ import annotations

from relay.config import RUN_OPTIONS, default_value
from relay.metrics import metric_table

# How a metric's kind reads in the docs, and the suffix Prometheus gives its series.
_KIND = {
    "counter": ("counter", "_total"),
    "gauge": ("gauge", ""),
    "histogram": ("histogram", ""),
    "batch_histogram": ("histogram", ""),
    "info": ("gauge", "_info"),
}


def options_table() -> str:
    lines = ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
    for option in RUN_OPTIONS:
        if option.test_only:
            continue
        default = option.show(default_value(option)) or "(none)"
        variable = (
            f"`{option.env}` (or `{option.env_file}`)" if option.secret_file else f"`{option.env}`"
        )
        lines.append(f"| `{option.flag}` | {variable} | `{default}` | {option.help} |")
    return "\n".join(lines)


def metrics_table() -> str:
    lines = ["| metric | type | what it says |", "| --- | --- | --- |"]
    for spec in metric_table().values():
        kind, suffix = _KIND[spec["kind"]]
        labels = spec.get("labels", ["version"] if spec["kind"] == "info" else [])
        series = spec["name"] + suffix + ("{" + ",".join(labels) + "}" if labels else "")
        where = ", table-wide" if spec.get("table_wide") else ""
        lines.append(f"| `{series}` | {kind}{where} | {spec['readme']} |")
    return "\n".join(lines)


def with_tables(page: str) -> str:
    """``page`` with the text between each table's markers replaced by the table."""
    for marker, table in (("options", options_table()), ("metrics", metrics_table())):
        begin, end = f"<!-- {marker}:begin -->\n", f"\n<!-- {marker}:end -->"
        start, stop = page.index(begin) + len(begin), page.index(end)
        page = page[:start] + table + page[stop:]
    return page


if __name__ == "__main__":
    from pathlib import Path

    configuration = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    configuration.write_text(with_tables(configuration.read_text()))
    print(f"wrote the options and metrics tables into {configuration}")
