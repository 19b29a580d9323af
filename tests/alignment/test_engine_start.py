"""The published sitecustomize run for real: a stub engine interpreter records its environment.

The agent side is real (config from a plan, the vLLM runtime's ranks, `publish_map`, the
report listener on a real Unix socket); the engine is a Python process started with the
environment the webhook injects and the NVIDIA_VISIBLE_DEVICES the NVIDIA device plugin sets
(its `Allocate` answers `NVIDIA_VISIBLE_DEVICES=<uuid,uuid>` with the default
`deviceIDStrategy: uuid`; NVIDIA/k8s-device-plugin internal/plugin/server.go). Python runs
sitecustomize from PYTHONPATH before the main module (the `site` module, docs.python.org
"site — Site-specific configuration hook"), which is what makes this reach vLLM before torch.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.agent import config as agent_config
from weightcache.agent.alignment import ReportServer, publish_map
from weightcache.agent.runtimes.vllm import VllmRuntime
from weightcache.contracts import alignment as al

STUB = """
import json, os, subprocess, sys
keys = ("CUDA_VISIBLE_DEVICES", "WEIGHTCACHE_ALIGN_DONE")
record = {k: os.environ.get(k) for k in keys}
if len(sys.argv) > 2 and sys.argv[2] == "--spawn":
    # vLLM's workers are child interpreters: they inherit the order and do not redo it.
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get("
                            "'CUDA_VISIBLE_DEVICES'))"], capture_output=True, text=True)
    record["child"] = child.stdout.strip()
    record["child_stderr"] = child.stderr
with open(sys.argv[1], "w") as fh:
    json.dump(record, fh)
"""


class Node:
    """One node's agent-side files for a cache, and the engines started against it."""

    def __init__(self, root: Path, tp: int, gpus: int = 8) -> None:
        self.root = root
        self.socket_dir = str(root / "s")
        os.makedirs(self.socket_dir, mode=0o700)
        self.ids = gpu_uuids(gpus)
        plan = make_plan(tensor=tp, data=gpus // tp, spec_extra={"socketDir": self.socket_dir})
        plan["layout"]["replicasPerNode"] = gpus // tp
        env = agent_config.AgentEnv(cache="llama", namespace="default", node="gpu-a",
                                    pod_ip="127.0.0.1", pod_name="agent", plan_path="")
        self.cfg = agent_config.build_config(
            env, agent_config.parse_plan(json.dumps(plan)),
            {"NVIDIA_VISIBLE_DEVICES": ",".join(self.ids)})
        self.ranks = VllmRuntime(self.cfg).ranks()
        self.reports = ReportServer(self.cfg)
        self.tp = tp
        self.stub = root / "engine.py"
        self.stub.write_text(STUB)

    def publish(self) -> None:
        publish_map(self.cfg, self.ranks)
        self.reports.start()

    def engine_env(self, visible: list[str] | None, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": f"{self.socket_dir}/{al.PYTHON_DIR}",
            al.ENV_SOCKET_DIR: self.socket_dir,
            al.ENV_TP: str(self.tp),
            al.ENV_DP_LOCAL: "1",
            "POD_NAME": "engine-0",
        }
        if visible is not None:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(visible)
        # Each engine start is a fresh container: its own /tmp.
        env["TMPDIR"] = tempfile.mkdtemp(dir=self.root)
        env.update(extra)
        return env

    def start_engine(self, env: dict[str, str], *args: str) -> tuple[dict[str, Any], str]:
        out = self.root / f"record-{time.monotonic_ns()}.json"
        proc = subprocess.run([sys.executable, str(self.stub), str(out), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text()), proc.stderr

    def wait_reports(self, total: int) -> dict[str, int]:
        deadline = time.monotonic() + 30
        while sum(self.reports.results.values()) < total:
            assert time.monotonic() < deadline, self.reports.results
            time.sleep(0.02)
        return dict(self.reports.results)


@pytest.fixture
def node() -> Iterator[Any]:
    made: list[Node] = []
    root = Path(tempfile.mkdtemp(prefix="wca", dir="/tmp"))  # short: AF_UNIX path limit

    def make(tp: int) -> Node:
        n = Node(root / str(len(made)), tp)
        made.append(n)
        return n

    root.mkdir(exist_ok=True)
    yield make
    for n in made:
        n.reports.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_published_files_are_read_only_and_describe_every_gpu(node: Any) -> None:
    n = node(2)
    n.publish()
    path = Path(n.socket_dir) / al.MAP_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(os.stat(n.socket_dir).st_mode) == 0o700
    site = Path(n.socket_dir) / al.PYTHON_DIR / "sitecustomize.py"
    assert stat.S_IMODE(site.stat().st_mode) == 0o644
    assert stat.S_IMODE((Path(n.socket_dir) / al.REPORT_SOCKET).stat().st_mode) == 0o600
    parsed = al.read_map(n.socket_dir)
    assert [parsed.gpus[u].tp_rank for u in n.ids] == [0, 1] * 4
    assert [parsed.gpus[u].replica for u in n.ids] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert parsed.gpus[n.ids[3]].sockets == {"target": os.path.basename(n.ranks[3].socket_path)}
    assert parsed.identity["tpSize"] == 2 and parsed.identity["cache"] == "llama"
    assert not [p for p in os.listdir(n.socket_dir) if p.startswith(".tmp")]


def test_engine_given_gpus_1_2_runs_rank0_on_gpu2(node: Any) -> None:
    n = node(2)
    n.publish()
    record, stderr = n.start_engine(n.engine_env([n.ids[1], n.ids[2]]))
    assert record["CUDA_VISIBLE_DEVICES"] == f"{n.ids[2]},{n.ids[1]}"
    assert "GPU alignment: all 2 rank(s)" in stderr
    assert n.wait_reports(1)["aligned"] == 1 and n.reports.missed_ranks == 0


def test_stub_nvidia_smi_when_the_runtime_exposes_all(node: Any, tmp_path: Path) -> None:
    n = node(4)
    n.publish()
    smi = tmp_path / "nvidia-smi"
    listed = "\n".join([n.ids[6], n.ids[5], n.ids[4], n.ids[7]])
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = --query-gpu=uuid ] || exit 3\necho '{listed}'\n")
    smi.chmod(0o755)
    env = n.engine_env(None, NVIDIA_VISIBLE_DEVICES="all")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    record, _ = n.start_engine(env)
    assert record["CUDA_VISIBLE_DEVICES"] == ",".join(n.ids[4:8])


def test_partial_cover_warns_counts_and_still_starts(node: Any, caplog: Any) -> None:
    n = node(4)
    n.publish()
    given = [n.ids[1], n.ids[2], n.ids[3], n.ids[5]]  # tp_ranks 1, 2, 3, 1: no tp_rank 0
    with caplog.at_level("WARNING", logger="weightcache.agent.alignment"):
        record, stderr = n.start_engine(n.engine_env(given))
        assert n.wait_reports(1)["partial"] == 1
    order = record["CUDA_VISIBLE_DEVICES"].split(",")
    assert order[1:] == [n.ids[1], n.ids[2], n.ids[3]] and order[0] == n.ids[5]
    assert "WARNING GPU alignment partial: 1 of 4 rank(s) load from disk" in stderr
    assert f"rank 0 (tp_rank 0) on {n.ids[5]}, which holds tp_rank 1" in stderr
    assert n.reports.missed_ranks == 1
    assert f"rank 0 (tp_rank 0) on {n.ids[5]} holding tp_rank 1" in caplog.text
    assert "engine-0" in caplog.text


def test_children_inherit_and_do_not_report_again(node: Any) -> None:
    n = node(2)
    n.publish()
    record, _ = n.start_engine(n.engine_env([n.ids[5], n.ids[4]]), "--spawn")
    assert record["CUDA_VISIBLE_DEVICES"] == record["child"] == f"{n.ids[4]},{n.ids[5]}"
    assert record["child_stderr"] == ""
    assert n.wait_reports(1) == {"aligned": 1, "partial": 0, "missed": 0, "skipped": 0}


def test_pod_order_is_kept_and_missing_map_still_starts(node: Any) -> None:
    n = node(2)
    record, stderr = n.start_engine(n.engine_env([n.ids[1], n.ids[2]]))  # no agent yet
    assert record["CUDA_VISIBLE_DEVICES"] is None and stderr == ""
    n.publish()
    os.unlink(os.path.join(n.socket_dir, al.MAP_NAME))  # code there, map gone
    record, stderr = n.start_engine(n.engine_env([n.ids[1], n.ids[2]]))
    assert record["CUDA_VISIBLE_DEVICES"] is None
    assert "GPU alignment skipped: cannot read" in stderr
    env = n.engine_env([n.ids[1], n.ids[2]], CUDA_VISIBLE_DEVICES=n.ids[1])
    record, stderr = n.start_engine(env)
    assert record["CUDA_VISIBLE_DEVICES"] == n.ids[1]
    assert "CUDA_VISIBLE_DEVICES is already set" in stderr


def test_the_images_own_sitecustomize_still_runs(node: Any, tmp_path: Path) -> None:
    n = node(2)
    n.publish()
    image_site = tmp_path / "image-site"
    image_site.mkdir()
    marker = tmp_path / "ran"
    (image_site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    env = n.engine_env([n.ids[0], n.ids[1]])
    env["PYTHONPATH"] += f":{image_site}"
    record, _ = n.start_engine(env)
    assert record["CUDA_VISIBLE_DEVICES"] == f"{n.ids[0]},{n.ids[1]}"
    assert marker.read_text() == "yes"


def test_report_listener_refuses_garbage_and_keeps_serving(node: Any) -> None:
    import socket as so

    n = node(2)
    n.publish()
    path = os.path.join(n.socket_dir, al.REPORT_SOCKET)
    for payload in (b"not json\n", b'{"result": "bogus"}\n', b"x" * (al.MAX_REPORT_BYTES + 10)):
        with so.socket(so.AF_UNIX, so.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(payload)
    n.start_engine(n.engine_env([n.ids[0], n.ids[1]]))
    assert n.wait_reports(1)["aligned"] == 1


def test_later_interpreters_of_a_container_reuse_the_decision(node: Any) -> None:
    n = node(2)
    n.publish()
    env = n.engine_env([n.ids[3], n.ids[2]])
    first, _ = n.start_engine(env)
    assert first["CUDA_VISIBLE_DEVICES"] == f"{n.ids[2]},{n.ids[3]}"
    # `kubectl exec ... python`: the container's spec environment, same /tmp, a fresh tree.
    again, stderr = n.start_engine(env)
    assert again["CUDA_VISIBLE_DEVICES"] == first["CUDA_VISIBLE_DEVICES"] and stderr == ""
    assert n.wait_reports(1)["aligned"] == 1
    assert sum(n.reports.results.values()) == 1  # one container start, one report


def test_mig_devices_are_left_alone(node: Any) -> None:
    n = node(2)
    n.publish()
    env = n.engine_env(None, NVIDIA_VISIBLE_DEVICES="MIG-4f1a2b3c-0000-1111-2222-333344445555")
    record, stderr = n.start_engine(env)
    assert record["CUDA_VISIBLE_DEVICES"] is None and "MIG devices are not aligned" in stderr


def test_native_client_reports_once(node: Any, monkeypatch: Any) -> None:
    from weightcache.native.engine import rank_devices as native

    n = node(2)
    n.publish()
    monkeypatch.setenv(al.ENV_ACTIVE, "")  # restored afterwards, whatever the call sets
    monkeypatch.setenv("POD_NAME", "native-engine")
    visible = [n.ids[1], n.ids[3]]  # both hold tp_rank 1: rank 1 hits, rank 0 misses
    assert native.rank_devices(2, socket_dir=n.socket_dir, visible=visible) == [1, 0]
    assert native.rank_devices(2, socket_dir=n.socket_dir, visible=visible) == [1, 0]
    assert n.wait_reports(1)["partial"] == 1 and n.reports.missed_ranks == 1
    assert sum(n.reports.results.values()) == 1
    assert n.reports.recent()[0].pod == "native-engine"
