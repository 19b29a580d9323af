"""Seeding new replicas with vLLM's real code: the agent's seed flags and `--config` file, for
a source cache and a target cache the operator planned, parsed by vLLM's preload parser,
validated by `_validate_seed_args`, and one real `SeedTransport` round trip between the two
(each side a fresh process, tests/conformance/seed_probe.py): the source's table lands at the
path the target's engine reads; with a wrong token nothing is installed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.conftest import HERE, INSTALL, runtime_for
from tests.conformance.test_warmup import cache_obj, engine_side, probe
from weightcache.agent import warmup as agent_warmup
from weightcache.api.v1alpha1 import WeightCacheSpec
from weightcache.contracts.plan import SeedSource
from weightcache.operator import resources

PROBE = HERE / "seed_probe.py"
TOKEN, WRONG = "5e" * 32, "0f" * 32
TABLE = {"('op', 'Runner', (1,), ())": [0, 3]}
RANK = 1  # the daemon of global rank 1 (TP 2): port base + 1


def free_base(n: int) -> int:
    """A base port with `n` free ports above it (loopback), below the kernel's ephemeral range:
    vLLM binds it only later, and a port the kernel hands out for `bind(0)` meanwhile (another
    test worker's) could take it first (seen once: EADDRINUSE in the source's bind)."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(50):
        base = random.randrange(10000, max(10001, low - n))
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port block")


def env_for(version: str, extra: dict[str, str]) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(INSTALL / version),
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "FLASHINFER_CUDA_ARCH_LIST": "9.0", "HOME": "/tmp",
            **{k: v for k, v in extra.items() if k != "PYTHONPATH"}}


def agent_side(cache: dict[str, Any], token: str, tmp: Path,
               seed_from: SeedSource | None = None) -> tuple[list[str], dict[str, str]]:
    """The agent's real `vllm preload` argv (its `--config` file written) and environment."""
    spec = WeightCacheSpec.from_object(cache)
    plan = json.loads(resources.plan(cache, spec, ["gpu-a"], epoch=1, seed_from=seed_from)
                      .to_json())
    rt = runtime_for(plan, pod_ip="127.0.0.1")
    (tmp / "token").write_text(token)
    rt.seed_token_path = str(tmp / "token")
    rt.seed_config_dir = str(tmp / "cfg")
    state = agent_warmup.prepare(rt.cfg)
    assert state.path and not state.unsafe
    rt.warmup_root = state.path
    env = {k: v for k, v in rt.environment().items() if v is not None}
    return rt.command()[1:], env


@pytest.fixture(scope="module")
def caches(models, tmp_path_factory) -> dict[str, Any]:
    base = free_base(2)
    old = cache_obj(models["dense"], tmp_path_factory.mktemp("warm-old"), 2)
    old["metadata"].update(name="old", uid="uid-old")
    old["spec"]["ports"] = {"seed": base}
    new = cache_obj(models["dense"], tmp_path_factory.mktemp("warm-new"), 2)
    new["metadata"].update(name="llama", uid="uid-new")
    new["spec"]["warmup"]["seed"] = {"from": "old"}
    # What the operator puts into the target's plan once `old` is Ready.
    peer = SeedSource(cache="old", port=base, hosts={0: "127.0.0.1"})
    src_argv, src_env = agent_side(old, TOKEN, tmp_path_factory.mktemp("agent-old"))
    dst_argv, dst_env = agent_side(new, TOKEN, tmp_path_factory.mktemp("agent-new"), peer)
    bad_argv, bad_env = agent_side(new, WRONG, tmp_path_factory.mktemp("agent-bad"), peer)
    assert bad_env == dst_env
    return {"base": base, "new": new, "source": (src_argv, src_env),
            "target": (dst_argv, dst_env), "wrong": bad_argv}


def test_the_agents_argv_carries_no_token_and_vllm_reads_it_from_the_config(caches):
    for side in ("source", "target"):
        argv = caches[side][0]
        assert TOKEN not in json.dumps(argv)
        conf = Path(argv[argv.index("--config") + 1])
        assert oct(conf.stat().st_mode & 0o777) == "0o600"
        assert TOKEN in conf.read_text()
    src = caches["source"][0]
    assert "--seed-source-host" not in src and "--seed-listen-host" in src
    dst = caches["target"][0]
    assert "--seed-listen-host" not in dst and "--seed-source-host" in dst


def test_vllm_parses_validates_and_seeds_the_target_from_the_source(vllm, caches):
    src_argv, src_env = caches["source"]
    source = subprocess.Popen(
        [sys.executable, str(PROBE), "source",
         json.dumps({"argv": src_argv, "rank": RANK, "table": TABLE})],
        env=env_for(vllm.version, src_env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        assert source.stdout is not None
        line = source.stdout.readline()
        while line and not line.startswith("READY "):
            line = source.stdout.readline()
        assert line, source.stderr.read()[-3000:] if source.stderr else ""
        ready = json.loads(line[6:])
        base = caches["base"]
        assert ready["args"] == {"seed_listen_host": "127.0.0.1", "seed_listen_port": base,
                                 "seed_source_host": None, "seed_source_port": None,
                                 "seed_token": TOKEN}
        assert ready["bound"] == ["127.0.0.1", base + RANK]
        assert Path(ready["path"]).is_relative_to(Path(src_env["VLLM_CACHE_ROOT"]))

        dst_argv, dst_env = caches["target"]
        out = subprocess.run(
            [sys.executable, str(PROBE), "target",
             json.dumps({"argvs": [caches["wrong"], dst_argv], "rank": RANK})],
            env=env_for(vllm.version, dst_env), capture_output=True, text=True, timeout=300,
            cwd="/")
        lines = [x for x in out.stdout.splitlines() if x.startswith("OUT ")]
        assert lines, out.stderr[-3000:]
        wrong, right = json.loads(lines[-1][4:])
    finally:
        if source.stdin is not None:
            source.stdin.close()
        source.wait(30)
    assert wrong["args"]["seed_token"] == WRONG and wrong["installed"] is None
    assert right["args"] == {"seed_listen_host": None, "seed_listen_port": None,
                             "seed_source_host": "127.0.0.1", "seed_source_port": base,
                             "seed_token": TOKEN}
    assert json.loads(right["installed"]) == TABLE
    # Installed where the target's injected engine reads its table of that rank.
    assert Path(right["path"]).is_relative_to(Path(dst_env["VLLM_CACHE_ROOT"]))
    e_argv, e_env, _ = engine_side(caches["new"])
    engine = probe(vllm.version, e_argv, e_env, [0, RANK])
    assert engine["tables"][1] == right["path"]
