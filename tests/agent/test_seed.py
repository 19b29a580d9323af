"""The seed flags of `vllm preload` (agent/seed.py): a source listens, a target dials its
node rank's peer, the token reaches vLLM only through a 0600 `--config` file, never argv or
the agent's log. vLLM's own parser reads these files in tests/conformance/test_seed.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import yaml

from tests.agent.plans import gpu_uuids, make_plan
from tests.agent.test_vllm_cmdline import runtime_for
from weightcache.agent import seed

TOKEN = "ab" * 32


def _rt(plan, tmp_path, node_rank=0, token=TOKEN):
    rt = runtime_for(plan, node_rank)
    path = tmp_path / "token"
    if token is not None:
        path.write_text(token + "\n")
    rt.seed_token_path = str(path)
    rt.seed_config_dir = str(tmp_path / "cfg")
    return rt


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv)
            if a.startswith("--seed-") or a == "--config"}


def target_plan(hosts=({"rank": 0, "host": "10.9.0.1"}, {"rank": 1, "host": "10.9.0.2"})):
    plan = make_plan(tensor=16, nodes=2, spec_extra={"warmup": {"seed": {"from": "old"}}})
    plan["seedFrom"] = {"cache": "old", "port": 29800, "hosts": list(hosts)}
    return plan


def test_a_source_listens_on_the_pod_ip_with_the_token_in_a_private_file(tmp_path, caplog):
    caplog.set_level("DEBUG")
    argv = _rt(make_plan(tensor=4), tmp_path).command()
    flags = _flags(argv)
    assert flags == {"--config": str(tmp_path / "cfg" / "seed.yaml"),
                     "--seed-listen-host": "10.1.2.3", "--seed-listen-port": "29700"}
    assert TOKEN not in " ".join(argv) and TOKEN not in caplog.text
    conf = tmp_path / "cfg" / "seed.yaml"
    assert yaml.safe_load(conf.read_text()) == {"seed-token": TOKEN}
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cfg").stat().st_mode) == 0o700
    # Every launch rewrites it (a rotated Secret reaches the next launch), leaving one file.
    (tmp_path / "token").write_text("cd" * 32)
    _rt(make_plan(tensor=4), tmp_path, token="cd" * 32).command()
    assert yaml.safe_load(conf.read_text()) == {"seed-token": "cd" * 32}
    assert os.listdir(tmp_path / "cfg") == ["seed.yaml"]


def test_a_target_dials_the_peer_of_its_node_rank_and_does_not_listen(tmp_path):
    for rank, host in ((0, "10.9.0.1"), (1, "10.9.0.2")):
        flags = _flags(_rt(target_plan(), tmp_path, node_rank=rank).command())
        assert flags == {"--config": str(tmp_path / "cfg" / "seed.yaml"),
                         "--seed-source-host": host, "--seed-source-port": "29800"}


def test_no_seed_flags_without_a_peer_a_token_or_world_size_above_one(tmp_path):
    cases = {
        "no ready peer on node rank 1": _rt(target_plan(hosts=[{"rank": 0, "host": "h"}]),
                                            tmp_path, node_rank=1),
        "plan without seedFrom": _rt(make_plan(
            tensor=2, spec_extra={"warmup": {"seed": {"from": "old"}}}), tmp_path),
        "no token (optional Secret absent)": _rt(make_plan(tensor=4), tmp_path / "x",
                                                 token=None),
        "world size 1": _rt(make_plan(tensor=1), tmp_path),
        "seeding off": _rt(make_plan(tensor=4, spec_extra={
            "warmup": {"seed": {"enabled": False}}}), tmp_path),
        "warmup off": _rt(make_plan(tensor=4, spec_extra={"warmup": {"enabled": False}}),
                          tmp_path),
    }
    for why, rt in cases.items():
        assert _flags(rt.command()) == {}, why


def test_world_size_one_says_why():
    plan = make_plan(tensor=1)
    why = seed.plan_seeding(runtime_for(plan).cfg).why
    assert "world size > 1" in why and "v2 store" in why


def test_a_token_that_is_not_one_printable_word_is_refused(tmp_path):
    for bad in (b"", b"two words", b"\xff\xfe", b"x" * 5000, b"a\x00b"):
        (tmp_path / "t").write_bytes(bad)
        assert seed.read_token(str(tmp_path / "t")) is None, bad
    assert seed.read_token(str(tmp_path / "missing")) is None


def test_the_real_agent_passes_the_token_only_in_the_config_file(agents, vllm_bin, tmp_path):
    """The agent process with the stand-in launcher: argv (which the supervisor logs and the
    host's /proc shows) and the agent's whole log hold no token; the file does."""
    args_out = tmp_path / "argv.json"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    (tmp_path / "tmp").mkdir()
    agent = agents(make_plan(tensor=2), env={
        "WEIGHTCACHE_VLLM_BIN": vllm_bin, "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids(2)),
        "FAKE_VLLM_ARGS_OUT": str(args_out), "WEIGHTCACHE_SEED_TOKEN_FILE": str(token_file),
        "TMPDIR": str(tmp_path / "tmp")}).start()
    agent.wait_ready(timeout=60)
    argv = json.loads(args_out.read_text())
    flags = _flags(argv)
    assert flags["--seed-listen-host"] == "127.0.0.1"
    assert flags["--seed-listen-port"] == str(agent.plan["spec"]["ports"].get("seed", 29700))
    assert yaml.safe_load(Path(flags["--config"]).read_text()) == {"seed-token": TOKEN}
    assert TOKEN not in json.dumps(argv)
    assert "--config" in agent.log() and TOKEN not in agent.log()
