"""The tools' failure modes that need no server: a missing binary is one line."""

from __future__ import annotations

import pytest

from relay import cli
from relay_tools import localservers
from relay_tools.bench import command, harness
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


def test_free_ports_are_below_the_source_port_range_and_never_repeat():
    ephemeral = localservers._ephemeral_range()
    ports = [localservers.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if ephemeral.start > 11_000:
        assert all(port < ephemeral.start for port in ports), ports


def test_free_port_reads_the_kernels_source_port_range(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert localservers._ephemeral_range(setting) == range(40000, 50001)
    assert localservers._ephemeral_range(tmp_path / "absent") == range(32768, 61000)


def test_machine_busy_time_counts_every_state_but_idle_and_iowait():
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  1000 20 300 5000 400 5 75 0 60 0\ncpu0 500 10 150 2500 200 2 37 0 30 0\n"
    assert harness.busy_seconds(stat, 100) == (1000 + 20 + 300 + 5 + 75) / 100


def test_the_bench_says_how_far_the_fast_batch_target_is_from_the_ceiling():
    report = command.Report()
    report.add("publish_rate", "floor", "msgs/s", [30_000.0])
    report.add("drain_mode_batch_rate", "drain", "rows/s", [30_000.0])
    report.add("ceiling_mode_batch", "ceiling", "rows/s", [40_000.0])
    drained, target = command.context(report)
    assert "at 0.75 of their ceiling" in drained
    assert "40,000 rows/s" in drained
    assert "would be 0.90 of that ceiling" in target
