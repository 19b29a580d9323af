"""A real agent process publishes the GPU map at start-up and exports engines' alignment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

from tests.agent.plans import gpu_uuids, make_plan
from weightcache.contracts import alignment as al


def test_agent_publishes_map_and_counts_engine_starts(agents, vllm_bin):
    ids = gpu_uuids(8)
    plan = make_plan(tensor=2, data=4)
    plan["layout"]["replicasPerNode"] = 4
    agent = agents(plan, env={"WEIGHTCACHE_VLLM_BIN": vllm_bin,
                              "NVIDIA_VISIBLE_DEVICES": ",".join(ids)}).start()
    agent.wait_ready(timeout=60)
    gpu_map = al.read_map(agent.socket_dir)
    assert [gpu_map.gpus[u].tp_rank for u in ids] == [0, 1] * 4
    assert gpu_map.identity["epoch"] == plan["epoch"]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{agent.socket_dir}/{al.PYTHON_DIR}",
           al.ENV_SOCKET_DIR: agent.socket_dir, al.ENV_TP: "2", "POD_NAME": "engine-a"}
    for given in ([ids[1], ids[2]], [ids[0], ids[2]]):  # covering, then two tp_rank-0 GPUs
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(given)
        env["TMPDIR"] = tempfile.mkdtemp(dir=agent.sock_root)  # each start a fresh container
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    where = r'cache="llama",namespace="[^"]+",node="[^"]+"'
    want = (rf'weightcache_engine_alignment_total\{{{where},result="aligned"\}} 1\.0',
            rf'weightcache_engine_alignment_total\{{{where},result="partial"\}} 1\.0',
            rf'weightcache_engine_alignment_missed_ranks_total\{{{where}\}} 1\.0')
    deadline = time.monotonic() + 30
    while True:
        _, text = agent.http("/metrics")
        if all(re.search(w, text) for w in want) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for w in want:
        assert re.search(w, text), (w, text)
    assert "started partial: 1 rank(s) load from disk" in agent.log()
    (miss,) = agent.status().alignment_misses  # what the operator turns into a pod event
    assert (miss.seq, miss.pod, miss.result, miss.missed_ranks) == (1, "engine-a", "partial", 1)
    assert f"rank 1 (tp_rank 1) on {ids[2]} holding tp_rank 0" in miss.detail
    assert agent.terminate() == 0
    assert not os.path.exists(os.path.join(agent.socket_dir, al.REPORT_SOCKET))
