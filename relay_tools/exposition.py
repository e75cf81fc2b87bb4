"""Reading a relay's /metrics page (Prometheus's text exposition format), for the
bench and the tests."""

from __future__ import annotations


def samples(text: str) -> dict[str, float]:
    """Each sample of an exposition as {'name{labels}': value}."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            found[key] = float(value)
    return found


def total(found: dict[str, float], name: str) -> float:
    """The sum of a metric's samples over all its labels, 0 if it has none."""
    return sum(value for key, value in found.items() if key == name or key.startswith(name + "{"))
