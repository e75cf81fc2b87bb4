"""The README's configuration table, generated from the options themselves.

``python -m relay.docs`` prints it; a test checks the README carries it as is.
"""

from __future__ import annotations

from relay.config import RUN_OPTIONS, default_value


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


if __name__ == "__main__":
    print(options_table())
