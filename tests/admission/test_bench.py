"""The admission benchmark runs end to end (numbers are reported, never asserted)."""

from __future__ import annotations

from weightcache.bench import admission as bench


def test_bench_runs_a_short_load() -> None:
    args = bench.parser().parse_args(["--rate", "50", "--duration", "1", "--warmup", "0.2"])
    result = bench.run(args)
    assert result["requests"] == 50
    assert result["errors"] == 0
    assert result["api_calls_for_cache"] == 0  # every admission answered from the index
    assert result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert set(result) >= {"p50_ms", "p99_ms", "rate_achieved", "decision_p50_ms", "target_met"}
