"""Smoke test of the `identity` bench section on a tiny checkpoint (no timing asserted)."""

from __future__ import annotations

from weightcache.bench import identity


def test_identity_section_runs_and_reports_both_tables(capsys):
    assert identity.main(["--small", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "load + digest (one pass, as the daemon runs it)" in out
    assert "sampled claim (client)" in out and "digest throughput" in out
