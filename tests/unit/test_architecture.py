"""ARCHITECTURE.md matches the tree: every path it names exists, and every module
of the runtime package is on the map."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = (ROOT / "ARCHITECTURE.md").read_text()


def test_every_path_on_the_map_exists():
    named = set(re.findall(r"\b((?:relay|relay_tools|sql|docs|tests)/[\w./]+\w)", MAP))
    assert named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, missing


def test_every_runtime_module_is_on_the_map():
    modules = {
        p.name
        for p in (ROOT / "relay").glob("*.py")
        if p.name not in {"__init__.py", "__main__.py"}
    }
    absent = sorted(
        name for name in modules if f"relay/{name}" not in MAP and f"`{name}`" not in MAP
    )
    assert not absent, f"not on ARCHITECTURE.md: {absent}"
