"""Named crash points for the fault tests. Off unless the test-only setting
``--failpoints`` (``OUTBOX_RELAY_FAILPOINTS``) names them."""

from __future__ import annotations

import os
import signal

CRASH_BEFORE_PUBLISH = "crash-before-publish"
CRASH_AFTER_PUBLISH = "crash-after-publish"
CRASH_AFTER_MARK = "crash-after-mark"
KNOWN = frozenset({CRASH_BEFORE_PUBLISH, CRASH_AFTER_PUBLISH, CRASH_AFTER_MARK})


class Failpoints:
    def __init__(self, enabled: frozenset[str]) -> None:
        self._enabled = enabled & KNOWN

    def enabled(self, name: str) -> bool:
        return name in self._enabled

    def hit(self, name: str) -> None:
        if name in self._enabled:
            # The harshest crash there is: no cleanup, no rollback from our side.
            os.kill(os.getpid(), signal.SIGKILL)
