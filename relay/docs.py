"""The configuration page's options, metrics and alerts tables
(docs/configuration.md), generated from the options, relay/metrics.toml and the
alerting rules (deploy/prometheus/alerts.yml).

``python -m relay.docs`` writes them into the page between their markers; a test
checks the page carries them as they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relay.config import RUN_OPTIONS, default_value
from relay.metrics import metric_table

ROOT = Path(__file__).resolve().parents[1]
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"

# How a metric's kind reads in the docs, and the suffix Prometheus gives its series.
_KIND = {
    "counter": ("counter", "_total"),
    "gauge": ("gauge", ""),
    "histogram": ("histogram", ""),
    "batch_histogram": ("histogram", ""),
    "info": ("gauge", "_info"),
}


def option_anchor(flag: str) -> str:
    """The id of an option's row in the options table, for links such as the
    runbooks' (``--max-attempts``: ``option-max-attempts``)."""
    return "option-" + flag.removeprefix("--")


def options_table() -> str:
    lines = ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |"]
    for option in RUN_OPTIONS:
        if option.test_only:
            continue
        default = option.show(default_value(option)) or "(none)"
        variable = (
            f"`{option.env}` (or `{option.env_file}`)" if option.secret_file else f"`{option.env}`"
        )
        anchor = option_anchor(option.flag)
        lines.append(
            f'| <a id="{anchor}"></a>`{option.flag}` | {variable} | `{default}` | {option.help} |'
        )
    return "\n".join(lines)


def metrics_table() -> str:
    lines = ["| metric | type | what it says |", "| --- | --- | --- |"]
    for spec in metric_table().values():
        kind, suffix = _KIND[spec["kind"]]
        labels = spec.get("labels", ["version"] if spec["kind"] == "info" else [])
        series = spec["name"] + suffix + ("{" + ",".join(labels) + "}" if labels else "")
        where = ", table-wide" if spec.get("table_wide") else ""
        anchor = spec["name"] + suffix
        lines.append(f'| <a id="{anchor}"></a>`{series}` | {kind}{where} | {spec["readme"]} |')
    return "\n".join(lines)


def alert_rules(path: Path = ALERT_RULES) -> list[Mapping[str, Any]]:
    """The alerting rules of ``path``, in the file's order. PyYAML comes with the
    development tools, not with the relay."""
    import yaml  # noqa: PLC0415

    groups = yaml.safe_load(path.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def alerts_table(rules: Sequence[Mapping[str, Any]]) -> str:
    """One line an alert: its runbook, severity, how long it must hold, and its
    summary with the labels it names written as placeholders."""
    lines = ["| alert | severity | holds for | what it says |", "| --- | --- | --- | --- |"]
    for rule in rules:
        name = rule["alert"]
        summary = re.sub(r"\{\{ *\$labels\.(\w+) *\}\}", r"`<\1>`", rule["annotations"]["summary"])
        summary = summary.replace("|", "\\|")
        lines.append(
            f"| [{name}](runbooks.md#{name.lower()}) | {rule['labels']['severity']} "
            f"| {rule.get('for', '(at once)')} | {summary} |"
        )
    return "\n".join(lines)


def with_tables(page: str, rules: Sequence[Mapping[str, Any]]) -> str:
    """``page`` with the text between each table's markers replaced by the table."""
    tables = (
        ("options", options_table()),
        ("metrics", metrics_table()),
        ("alerts", alerts_table(rules)),
    )
    for marker, table in tables:
        begin, end = f"<!-- {marker}:begin -->\n", f"\n<!-- {marker}:end -->"
        start, stop = page.index(begin) + len(begin), page.index(end)
        page = page[:start] + table + page[stop:]
    return page


if __name__ == "__main__":
    configuration = ROOT / "docs" / "configuration.md"
    configuration.write_text(with_tables(configuration.read_text(), alert_rules()))
    print(f"wrote the options, metrics and alerts tables into {configuration}")
