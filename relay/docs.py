"""The README's configuration and metrics tables, generated from the options and
from relay/metrics.toml.

``python -m relay.docs`` prints both; a test checks the README carries them as is.
"""

from __future__ import annotations

from relay.config import RUN_OPTIONS, default_value
from relay.metrics import metric_table

# How a metric's kind reads in the README, and the suffix Prometheus gives its series.
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


if __name__ == "__main__":
    print("<!-- options:begin -->")
    print(options_table())
    print("<!-- options:end -->\n")
    print("<!-- metrics:begin -->")
    print(metrics_table())
    print("<!-- metrics:end -->")
