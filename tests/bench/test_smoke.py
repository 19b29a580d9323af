"""Every section of `weightcache bench` runs on CPU at its smallest size.

Benchmarks that nothing runs rot: the operator section once timed out on every run because its
stand-in DaemonSet controller read only the first node selector term, and nobody noticed
until someone measured. Figures are not checked here (they live in committed benchmark
output); what is checked is that each section finishes, exits 0 and prints its table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightcache.bench.report import SECTIONS
from weightcache.native.shared.earlyread import READ_JOBS

# Sections that measure a GPU and say so on CPU; every other section must really run here.
CUDA_ONLY = {"gpu"}
# Sections whose smoke size still compiles a model in fresh processes (restart: a cold Inductor
# compile of a 1-layer Llama takes tens of seconds on two shared cores).
TIMEOUT_S = {"restart": 600}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_section_runs_at_smoke_size(section: str, tmp_path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "WEIGHTCACHE_BENCH_RESTART_OUT": str(tmp_path / "restart.json"),
           "WEIGHTCACHE_BENCH_ATTACH_OUT": str(tmp_path / "attach.json")}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke", section],
        capture_output=True, text=True, timeout=TIMEOUT_S.get(section, 240), env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"({section}: " in proc.stdout and "exit 0)" in proc.stdout, out[-4000:]
    skipped = "skipped" in proc.stdout
    if section in CUDA_ONLY:
        assert skipped, out[-2000:]
    else:
        assert not skipped, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
    if section == "attach":  # a new process's first load came from the cache: each mode, binding
        fresh = json.loads((tmp_path / "attach.json").read_text())["fresh"]
        for mode in ("copy", "zero_copy", "copy_ctypes", "zero_copy_ctypes"):
            assert fresh[mode]["source"] == ["cache"], fresh
            assert len(fresh[mode]["first_ms"]) == fresh["rounds"] == 2, fresh
            assert fresh[mode]["second_median_ms"] > 0, fresh
        assert len(fresh["alloc"]["first_ms"]) == 2 and fresh["bytes"] > 0, fresh
    if section == "restart":  # the fresh node's daemon starts as a node's first start does
        fresh = json.loads((tmp_path / "restart.json").read_text())["fresh_node"]
        assert fresh["summary"]["cache_overlapped_seeded"] is True, fresh["summary"]
        assert fresh["seed"]["files"] > 0
        # Which start bounded the cache path: the daemon's READY and the engine's imports.
        summary = fresh["summary"]
        assert summary["cache_overlapped_daemon_ready_s"] > 0, summary
        assert summary["cache_overlapped_engine_imports_s"] > 0, summary
        assert summary["engine_imports_beside_load_vs_alone"] == pytest.approx(
            summary["cache_overlapped_engine_imports_s"] / summary["disk_engine_imports_s"],
            abs=1e-3), summary
        # Each phase's use splits its wall time: on a CPU, waiting for one, off a CPU.
        for key in ("cache_overlapped", "disk"):
            run = fresh[key]
            for phase in ("import_torch", "import_transformers"):
                used, wall = run["phase_use"][phase], run["phases"][phase]
                assert 0 < used["cpu_s"] <= wall + 0.01, (phase, used, wall)
                parts = used["cpu_s"] + (used["runqueue_s"] or 0) + used["off_cpu_s"]
                assert parts == pytest.approx(wall, abs=0.01), (phase, used, wall)
                assert used["major_faults"] >= 0 and used["process_cpu_s"] >= used["cpu_s"] - 0.01
            imports = summary[f"{key}_engine_imports_use"]
            assert imports["cpu_s"] == pytest.approx(
                sum(run["phase_use"][p]["cpu_s"] for p in ("import_torch", "import_transformers")),
                abs=2e-3), (imports, run["phase_use"])


def test_the_fresh_nodes_hold_ab_runs_both_holds_in_turn(tmp_path) -> None:
    """`restart`'s `holdab` part: the fresh node's cache path with the disk share as it is
    and as the comparison names it (here a half-second hold after a blip against the old
    second: `WEIGHTCACHE_BENCH_SHARE_BEFORE`), each READY's share saying which it ran with."""
    out = tmp_path / "restart.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WEIGHTCACHE_BENCH_RESTART_OUT": str(out),
           "WEIGHTCACHE_BENCH_RESTART_PARTS": "holdab", "WEIGHTCACHE_LOAD_HOLD_S": "0.5",
           "WEIGHTCACHE_BENCH_SHARE_BEFORE": "WEIGHTCACHE_LOAD_HOLD_S=1"}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke",
         "restart"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert "fresh_node" not in report and "restart_compile" not in report
    assert ("the disk share as it is (default) and as before, in turn (before: "
            "WEIGHTCACHE_LOAD_HOLD_S=1)") in proc.stdout, proc.stdout[-2000:]
    # The engine's first matrix product is timed apart from its first forward.
    phases = report["hold_ab"]["default_1"]["phases"]
    assert phases["first_gemm"] > 0 and phases["first_forward"] > 0, phases
    summary = report["hold_ab"]["summary"]
    assert set(summary) == {"default_1", "before_1"}, summary
    assert report["hold_ab"]["before_env"] == {"WEIGHTCACHE_LOAD_HOLD_S": "1"}
    for key, hold in (("default_1", 0.5), ("before_1", 1.0)):
        assert summary[key]["hold"] == hold, summary
        assert summary[key]["hold_max"] == 3.0, summary
        assert summary[key]["reads_seen"] is True, summary
    for row in summary.values():
        assert row["weights_from"] == "cache" and row["first_logits_s"] > 0, summary
        assert row["daemon_ready_s"] > 0 and row["engine_imports_s"] > 0, summary


def test_the_share_a_holdab_compares_with_is_named_or_refused(monkeypatch) -> None:
    """`WEIGHTCACHE_BENCH_SHARE_BEFORE`: the load knobs the `holdab` parts compare the default
    with; unset, the share as it was before the growing hold; anything but load knobs is
    refused before a checkpoint is written."""
    from weightcache.bench.load import SHARE_BEFORE, SHARE_BEFORE_ENV, share_before

    monkeypatch.delenv(SHARE_BEFORE_ENV, raising=False)
    assert share_before() == SHARE_BEFORE
    monkeypatch.setenv(SHARE_BEFORE_ENV,
                       " WEIGHTCACHE_LOAD_HOLD_S=1 , WEIGHTCACHE_LOAD_HOLD_MAX_S=2")
    assert share_before() == {"WEIGHTCACHE_LOAD_HOLD_S": "1", "WEIGHTCACHE_LOAD_HOLD_MAX_S": "2"}
    for bad in ("WEIGHTCACHE_LOAD_HOLD_S", "PATH=/tmp", "WEIGHTCACHE_LOAD_HOLD_S=1,junk",
                "WEIGHTCACHE_LOAD_HOLD_S="):
        monkeypatch.setenv(SHARE_BEFORE_ENV, bad)
        with pytest.raises(ValueError, match=SHARE_BEFORE_ENV):
            share_before()
    monkeypatch.setenv(SHARE_BEFORE_ENV, "PATH=/tmp")
    env = {**os.environ, "WEIGHTCACHE_BENCH_RESTART_PARTS": "holdab"}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke",
         "restart"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and SHARE_BEFORE_ENV in proc.stdout + proc.stderr
    assert "fresh node" not in proc.stdout


def _smoke_load(tmp_path, parts: str, layout: str) -> dict:
    """`weightcache bench --device cpu --smoke load` with these parts on one layout: its
    report's entry for the layout."""
    out = tmp_path / "load.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WEIGHTCACHE_BENCH_LOAD_PARTS": parts,
           "WEIGHTCACHE_BENCH_LOAD_LAYOUTS": layout, "WEIGHTCACHE_BENCH_LOAD_OUT": str(out),
           "WEIGHTCACHE_BENCH_LOAD_WORKDIR": str(tmp_path / "work")}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke", "load"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())["layouts"][layout]


def test_lean_hotstep_runs_the_warm_steps_alone(tmp_path):
    """`lean,hotstep`: the warm fill's A/B as a short GPU call: the warm baselines and READYs,
    each hash piece reaching the rank, and no cold step (no device read, no cold READY)."""
    layout = _smoke_load(tmp_path, "lean,hotstep", "sharded")
    summary = layout["summary"]
    assert not [k for k in layout if "cold" in k], sorted(layout)
    assert layout["load_file_warm"]["seconds"] > 0 and summary["preload_warm_ready_s"] > 0
    for mib in (16, 4):
        for suffix in ("", "_again"):
            key = f"preload_warm_hot_step{mib}{suffix}"
            assert layout[key]["ready"]["rank_loads"][0]["loader"]["hot_step_mib"] == mib
            assert summary[f"{key}_rank_gb_per_s"] > 0


def test_lean_holdab_and_importab_run_ready_with_each_setting_in_turn(tmp_path):
    """`lean,holdab`: READY with every cache dropped with the disk share as before and as it
    is, in turn, twice; each rank's share says which it ran with. `importab`: likewise with
    torch imported once the import set is read, the set read in a process of its own, and the
    set read beside the import; each rank's prefetch says whether its import waited and
    whether it read apart."""
    layout = _smoke_load(tmp_path, "lean,holdab,importab", "sharded")
    summary = layout["summary"]
    for key, waited, apart in (("preload_cold_importafter", True, False),
                               ("preload_cold_importapart", False, True),
                               ("preload_cold_importbeside", False, False)):
        for suffix in ("", "_again"):
            assert summary[f"{key}{suffix}_ready_s"] > 0, sorted(summary)
            prefetch = summary[f"{key}{suffix}_import_prefetch"]
            assert (prefetch["import_waited"] is not None) is waited, prefetch
            assert prefetch["apart"] is apart, prefetch
            assert prefetch["done"] is True and prefetch["files"] > 0, prefetch
    for key, hold_max, reads in (("preload_cold_holdbefore", 1.0, False),
                                 ("preload_cold_holdnow", 3.0, True)):
        for suffix in ("", "_again"):
            assert summary[f"{key}{suffix}_ready_s"] > 0, sorted(summary)
            assert summary[f"{key}{suffix}_disk"]["hold_max"] == hold_max
            assert summary[f"{key}{suffix}_disk"]["reads_seen"] is reads


def test_dropab_runs_each_variant_in_turn_with_the_default_and_refuses_bad_knobs(
        tmp_path, monkeypatch):
    """`dropab`: READY with every cache dropped, the default and each variant of
    `WEIGHTCACHE_BENCH_DROP_AB` in turn, each round starting one further along; each
    variant's knobs reach the rank; a bad list or round count is refused before a checkpoint
    is written."""
    from weightcache.bench.load import (
        DROP_AB_ENV,
        DROP_ROUNDS_ENV,
        drop_ab,
        drop_ab_steps,
        drop_rounds,
    )

    steps = drop_ab_steps([{"A": "1"}, {"B": "2"}], 3)
    assert [k.removeprefix("preload_cold_dropab_") for k, _ in steps] == [
        "default_1", "v1_1", "v2_1", "v1_2", "v2_2", "default_2", "v2_3", "default_3", "v1_3"]
    assert dict(steps)["preload_cold_dropab_v2_3"] == {"B": "2"}
    assert dict(steps)["preload_cold_dropab_default_2"] == {}
    for bad in ("", "PATH=/tmp", "WEIGHTCACHE_BENCH_DROP_ROUNDS=2", "WEIGHTCACHE_X",
                "WEIGHTCACHE_X=1;;junk"):
        monkeypatch.setenv(DROP_AB_ENV, bad)
        with pytest.raises(ValueError, match=DROP_AB_ENV):
            drop_ab()
    monkeypatch.setenv(DROP_AB_ENV, "WEIGHTCACHE_X=1, WEIGHTCACHE_Y=2;WEIGHTCACHE_Z=3")
    assert drop_ab() == [{"WEIGHTCACHE_X": "1", "WEIGHTCACHE_Y": "2"}, {"WEIGHTCACHE_Z": "3"}]
    for bad in ("0", "17", "two"):
        monkeypatch.setenv(DROP_ROUNDS_ENV, bad)
        with pytest.raises(ValueError, match=DROP_ROUNDS_ENV):
            drop_rounds()
    monkeypatch.delenv(DROP_ROUNDS_ENV)
    assert drop_rounds() == 3

    monkeypatch.setenv(DROP_AB_ENV, "WEIGHTCACHE_IMPORT_SET_THREADS=2;"
                       "WEIGHTCACHE_EARLY_READ_JOBS=1")
    monkeypatch.setenv(DROP_ROUNDS_ENV, "2")
    layout = _smoke_load(tmp_path, "lean,dropab", "sharded")
    summary = layout["summary"]
    ab = summary["dropab"]
    assert sorted(ab) == ["default", "v1", "v2"]
    for arm in ab.values():
        assert len(arm["ready_s"]) == 2 and all(x > 0 for x in arm["ready_s"]), ab
        assert len(arm["ready_vs_device_read"]) == 2 and arm["mean_s"] > 0
    for n in (1, 2):
        assert summary[f"preload_cold_dropab_v2_{n}_early"]["read_jobs"] == 1
        assert summary[f"preload_cold_dropab_default_{n}_early"]["read_jobs"] == READ_JOBS
    monkeypatch.setenv(DROP_AB_ENV, "PATH=/tmp")
    out = tmp_path / "refused.json"
    env = {**os.environ, "WEIGHTCACHE_BENCH_LOAD_PARTS": "lean,dropab",
           "WEIGHTCACHE_BENCH_LOAD_OUT": str(out),
           "WEIGHTCACHE_BENCH_LOAD_WORKDIR": str(tmp_path / "refused")}
    proc = subprocess.run(
        [sys.executable, "-m", "weightcache.cli", "bench", "--device", "cpu", "--smoke", "load"],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and DROP_AB_ENV in proc.stdout + proc.stderr
    assert not out.exists() and not (tmp_path / "refused").exists()


def test_the_load_sections_census_fillreads_readjobs_seed_and_hotstep_parts_run_at_smoke_size(
        tmp_path):
    """`census` (READY after an engine's cold start, with and without the import set's warm
    verdict), `fillreads` (the fill reading what it reaches first itself, or the early
    readers for it), `readjobs` (one job or several per early read call), `seed` (a node's
    first start reading an image's seed) and `hotstep` (the warm fill's hash piece) are a GPU
    run's A/Bs: their code runs here, and each knob reaches the rank."""
    layout = _smoke_load(tmp_path, "census,fillreads,readjobs,seed,hotstep", "sharded")
    summary = layout["summary"]
    # `hotstep`: the warm READY with 16 MiB hash pieces and with 4, twice, each with its rate,
    # and the rank's fill said which piece it hashed in.
    for mib in (16, 4):
        for suffix in ("", "_again"):
            key = f"preload_warm_hot_step{mib}{suffix}"
            assert summary[f"{key}_rank_gb_per_s"] > 0, key
            loader = layout[key]["ready"]["rank_loads"][0]["loader"]
            assert loader["hot_step_mib"] == mib, loader
    # `seed`: a node's first start again, reading the seed an agent image carries.
    seeded = summary["preload_cold_seeded_first_start_import_prefetch"]
    assert summary["preload_cold_seeded_first_start_ready_s"] > 0
    assert seeded["seeded"] is True and seeded["files"] > 0
    assert summary["preload_cold_import_prefetch"]["seeded"] is False
    for key in ("preload_cold_model_restart", "preload_cold_model_restart_nowarm",
                "preload_cold_model_restart_again"):
        assert summary[f"{key}_ready_s"] > 0, key
        assert summary[f"{key}_import_prefetch"]["files"] > 0, key
    assert summary["preload_cold_model_restart_nowarm_import_prefetch"]["warm"] is False
    for key, asked, jobs in (("preload_cold_model", False, READ_JOBS),
                             ("preload_cold_model_forfill", True, READ_JOBS),
                             ("preload_cold_model_fillreads_again", False, READ_JOBS),
                             ("preload_cold_model_forfill_again", True, READ_JOBS),
                             ("preload_cold_model_onejob", False, 1),
                             ("preload_cold_model_readjobs_again", False, READ_JOBS),
                             ("preload_cold_model_onejob_again", False, 1)):
        assert summary[f"{key}_ready_s"] > 0, key
        assert summary[f"{key}_early"]["for_fill"] is asked, key
        assert summary[f"{key}_early"]["read_jobs"] == jobs, key
    # The warm restart (libraries in memory too) against a fresh process's warm `load_file`.
    assert summary["preload_warm_again_ready_s"] > 0
    assert summary["load_file_process_warm_s"] > 0
    assert summary["preload_warm_again_ready_vs_load_file_process_warm"] > 0


def test_the_load_sections_lean_part_runs_only_the_device_reads_and_the_comparison(tmp_path):
    """`lean` (a short GPU call for an A/B): the device reads and the model-cold READYs of the
    parts asked for (and `seed`'s first starts), none of the baselines or warm steps;
    `startgentle`'s knob reaches the rank's share of the disk, `groupbeside`'s the rank's
    early reads, and `headstart`'s the launcher."""
    layout = _smoke_load(tmp_path, "lean,fillreads,startgentle,groupbeside,headstart,seed",
                         "many")
    summary = layout["summary"]
    # `seed` with `lean`: a first start with no set, with the image's seed, and a later one,
    # every cache dropped, twice in turn.
    for key, seeded, files in (("preload_cold_first_start", False, False),
                               ("preload_cold_seeded_first_start", True, True),
                               ("preload_cold", False, True)):
        for name in (key, f"{key}_again"):
            prefetch = summary[f"{name}_import_prefetch"]
            assert summary[f"{name}_ready_s"] > 0, name
            assert prefetch["seeded"] is seeded and (prefetch["files"] > 0) is files, name
    assert summary["device_read_s"] > 0 and len(summary["device_reads_s"]) == 2
    for key in ("preload_cold_model", "preload_cold_model_forfill",
                "preload_cold_model_fillreads_again", "preload_cold_model_forfill_again"):
        assert summary[f"{key}_ready_vs_device_read"] > 0, key
    # A rank with an import set (written by the READY before them) starts with no gentle span.
    for key, span in (("preload_cold_model", 0.0), ("preload_cold_model_gentlestart", 0.5),
                      ("preload_cold_model_startgentle_again", 0.0),
                      ("preload_cold_model_gentlestart_again", 0.5)):
        assert summary[f"{key}_ready_s"] > 0, key
        disk = summary[f"{key}_disk"]
        assert disk is not None and disk["start_gentle"] == span, key
    for key, jobs in (("preload_cold_model", 1), ("preload_cold_model_groupbeside", 4),
                      ("preload_cold_model_besidejobs_again", 1),
                      ("preload_cold_model_groupbeside_again", 4)):
        assert summary[f"{key}_ready_s"] > 0, key
        assert summary[f"{key}_early"]["beside_jobs"] == jobs, key
    # The launcher's head start off, then on, in turn: where it asked, the rank's early reads
    # left exactly what it asked to the fill.
    for key, on in (("preload_cold_model", True), ("preload_cold_model_nohead", False),
                    ("preload_cold_model_headstart_again", True),
                    ("preload_cold_model_nohead_again", False)):
        head = summary[f"{key}_head_start"]
        assert summary[f"{key}_ready_s"] > 0 and (head["verdict"] != "off") is on, key
        assert summary[f"{key}_early"]["ahead_bytes"] == (
            head["asked_bytes"] if head["verdict"] == "asked" else 0), key
    for key in ("load_file_cold", "from_pretrained_cold", "loader_cold",
                "load_file_process_cold", "load_file_warm", "preload_warm"):
        assert key not in layout, key
