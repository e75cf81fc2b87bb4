"""The tools' failure modes that need no server: a missing binary is one line."""

from __future__ import annotations

import pytest

from relay import cli
from relay_tools import localservers
from relay_tools.localservers import MissingServerBinary, postgres_binary


def test_missing_postgres_binaries_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MissingServerBinary, match="install the Postgres server binaries"):
        postgres_binary("initdb", search_root=tmp_path)


@pytest.mark.parametrize("command", [["demo", "--seconds", "1"], ["bench", "--quick"]])
def test_tools_report_a_missing_binary_in_one_line(capsys, monkeypatch, command):
    def missing(*_args, **_kwargs):
        raise MissingServerBinary("initdb not found: install the Postgres server binaries")

    monkeypatch.setattr(localservers, "postgres_binary", missing)
    monkeypatch.setattr(localservers.ThrowawayPostgres, "__init__", lambda self, **_: missing())
    assert cli.main(command, {}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "install the Postgres server binaries" in err[0]
