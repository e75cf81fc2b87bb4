"""Backoff decisions, as pure functions of the attempt count."""

from __future__ import annotations

import random
from dataclasses import dataclass


def row_retry_delay(attempts: int, base: float, cap: float) -> float:
    """Seconds a row waits after its ``attempts``-th failed publish: base, 2 x base,
    4 x base, ... never more than ``cap``."""
    if attempts < 1:
        raise ValueError("attempts counts failures and starts at 1")
    # Clamp the exponent first so a row with a huge attempt count cannot overflow.
    return min(base * 2.0 ** min(attempts - 1, 62), cap)


@dataclass
class ReconnectBackoff:
    """Delays between tries to reach a server that is down: exponential, capped, with
    jitter so several replicas do not reconnect in lockstep. ``reset`` after success."""

    initial: float = 0.1
    cap: float = 10.0
    failures: int = 0

    def next_delay(self, rng: random.Random | None = None) -> float:
        ceiling = min(self.initial * 2.0 ** min(self.failures, 30), self.cap)
        self.failures += 1
        jitter = (rng or random).uniform(0.5, 1.0)
        return ceiling * jitter

    def reset(self) -> None:
        self.failures = 0
