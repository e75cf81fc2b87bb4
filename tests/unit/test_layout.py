"""The runtime package stands apart from the tools: `outbox-relay run` imports no
module of relay_tools (bench, demo, throwaway servers)."""

from __future__ import annotations

import subprocess
import sys


def test_run_imports_no_tool_module():
    process = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "relay", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in process.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "relay.app" in imported  # what `run` does is all there
    assert "relay.batch" in imported
    assert not {name for name in imported if name.startswith("relay_tools")}
