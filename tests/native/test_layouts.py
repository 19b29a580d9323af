"""Multi-node tensor parallelism and data parallelism with the native launcher, on CPU.

Two launchers with `--nnodes 2 --node-rank 0/1` and their own socket directories stand for
two nodes; clients pick the socket of their own device and must get the shard of their
TP rank, byte-equal to a manual split of the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from weightcache.contracts.layout import Layout, RankLayoutError
from weightcache.native.daemon import launcher as preload
from weightcache.native.engine.attach import FingerprintMismatchError, attach, query
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.processes import run_attach, weightcache_cmd

from .conftest import private_dir
from .test_attach import EMBED, HEAD, reference

# The default Llama preset's split dims (sharding.LLAMA_RULES).
DIMS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
        "o_proj": 1, "down_proj": 1, "embed_tokens": 0}


def manual_shard(full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in full.items():
        dim = next((d for key, d in DIMS.items() if f"{key}.weight" in name), None)
        out[name] = tensor if dim is None else torch.chunk(tensor, tp, dim=dim)[rank]
    return out


# CPU "devices" are cores: the launcher refuses more local ranks than the machine has.
two_devices = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def _layout(**kw: int) -> Layout:
    """A layout from the launcher's flags under vLLM's names (unset ones at their defaults)."""
    names = {"tensor_parallel_size": "tensor", "data_parallel_size": "data", "nnodes": "nodes",
             "node_rank": "node_rank", "data_parallel_size_local": "data_local",
             "data_parallel_start_rank": "data_start"}
    return Layout(**{names[k]: v for k, v in kw.items()})


def places(**kw: int) -> list[tuple[int, int, int]]:
    return [(p.global_rank, p.tp_rank, p.dp_rank) for p in _layout(**kw).local_ranks()]


@two_devices
def test_tp4_over_two_nodes(ckpt, tmp_path, preload):
    dirs = [private_dir(tmp_path / f"node{r}") for r in (0, 1)]
    nodes = [preload("--model", str(ckpt), "--tensor-parallel-size", "4", "--nnodes", "2",
                     "--node-rank", str(r), "--weight-cache-socket-dir", str(dirs[r]))
             for r in (0, 1)]
    ready = [n.wait_ready(120) for n in nodes]
    for r, info in enumerate(ready):
        assert info["ranks"] == 2
        assert info["global_ranks"] == [2 * r, 2 * r + 1]
        assert info["tp_ranks"] == [2 * r, 2 * r + 1] and info["dp_ranks"] == [0, 0]
        # Sockets are named after the local device, so both nodes use the same names.
        assert info["sockets"] == [str(socket_path(dirs[r], cpu_identity(i))) for i in (0, 1)]

    ref = reference(ckpt)
    for tp_rank in range(4):
        node, local = divmod(tp_rank, 2)
        res = attach(ckpt, tp_size=4, tp_rank=tp_rank, device_index=local,
                     socket_dir=dirs[node], fallback=False)
        assert res.source == "cache"
        assert res.socket == str(socket_path(dirs[node], cpu_identity(local)))
        want = manual_shard(ref, 4, tp_rank)
        for name, tensor in want.items():
            assert torch.equal(res.state_dict[name], tensor), (tp_rank, name)
        assert res.state_dict[HEAD] is res.state_dict[EMBED]
        hello = query(res.socket, "hello")
        assert (hello["rank"], hello["tp_size"], hello["global_rank"], hello["dp_rank"]) \
            == (tp_rank, 4, tp_rank, 0)

    # The CLI, as an engine worker of TP rank 3 on node 1's device 1, verifying every byte.
    out = run_attach(["--model", str(ckpt), "--tensor-parallel-size", "4", "--rank", "3",
                      "--device-index", "1", "--weight-cache-socket-dir", str(dirs[1]),
                      "--no-fallback", "--verify-bytes"])
    assert out["source"] == "cache" and out["verified"] is True

    # A client on the wrong device of node 1 reaches a daemon of another TP rank: refused.
    with pytest.raises(FingerprintMismatchError) as info:
        attach(ckpt, tp_size=4, tp_rank=2, device_index=1, socket_dir=dirs[1], fallback=False)
    assert info.value.fields == ["tp_rank"]

    # Two launchers of one machine sharing a socket dir collide on the device identity.
    t0 = time.monotonic()
    clash = subprocess.run(
        [*weightcache_cmd(), "preload", "--exit-with-parent", "--model", str(ckpt),
         "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
         "--weight-cache-socket-dir", str(dirs[0])],
        capture_output=True, text=True, timeout=60)
    assert clash.returncode == 3, clash.stderr
    assert "already" in clash.stderr and time.monotonic() - t0 < 30


@two_devices
def test_dp2_tp1_one_node(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--tensor-parallel-size", "1", "--data-parallel-size", "2",
                "--weight-cache-socket-dir", str(sock_dir))
    info = p.wait_ready(120)
    assert info["ranks"] == 2
    assert (info["global_ranks"], info["tp_ranks"], info["dp_ranks"]) == ([0, 1], [0, 0], [0, 1])
    ref = reference(ckpt)
    states = []
    for local in (0, 1):
        # Both replicas serve TP rank 0: a client attaches to the one on its own device.
        res = attach(ckpt, tp_size=1, tp_rank=0, device_index=local, socket_dir=sock_dir,
                     fallback=False)
        assert res.source == "cache"
        assert res.socket == str(socket_path(sock_dir, cpu_identity(local)))
        for name, tensor in ref.items():
            assert torch.equal(res.state_dict[name], tensor), (local, name)
        hello = query(res.socket, "hello")
        assert (hello["rank"], hello["global_rank"], hello["dp_rank"]) == (0, local, local)
        states.append(res.state_dict)
    # Two replicas: separate arenas, not one shared mapping.
    assert states[0][EMBED].data_ptr() != states[1][EMBED].data_ptr()


def test_layout_rules_follow_vllm():
    # Multi-node TP (seed: TP16 over 2 nodes): node r serves r * 8 + i.
    assert places(tensor_parallel_size=16, nnodes=2, node_rank=1) == \
        [(8 + i, 8 + i, 0) for i in range(8)]
    # TP1 x DP16 over 4 nodes, DP placement form: dp = start + i // tp.
    by_placement = places(tensor_parallel_size=1, data_parallel_size=16,
                          data_parallel_size_local=4, data_parallel_start_rank=8)
    assert by_placement == [(8 + i, 0, 8 + i) for i in range(4)]
    # ... and the --nnodes form gives the same block.
    assert places(tensor_parallel_size=1, data_parallel_size=16, nnodes=4, node_rank=2) \
        == by_placement
    # TP8 x DP2 over 4 nodes: each TP group spans two nodes.
    assert places(tensor_parallel_size=8, data_parallel_size=2, nnodes=4, node_rank=3,
                  data_parallel_size_local=1, data_parallel_start_rank=1) == \
        [(12 + i, 4 + i, 1) for i in range(4)]
    # TP2 x DP2 on one node: dp = i // tp, tp = i % tp.
    assert places(tensor_parallel_size=2, data_parallel_size=2) == \
        [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]


@pytest.mark.parametrize(("flags", "flag", "message"), [
    ({"tensor_parallel_size": 4, "nnodes": 2, "node_rank": 2}, "--node-rank",
     "between 0 and 1"),
    ({"tensor_parallel_size": 4, "nnodes": 3}, "--nnodes", "do not split the world of 4"),
    ({"tensor_parallel_size": 2, "data_parallel_size": 3, "nnodes": 2},
     "--tensor-parallel-size", "whole number of tensor-parallel groups of 2"),
    ({"tensor_parallel_size": 6, "data_parallel_size": 2, "nnodes": 3},
     "--tensor-parallel-size", "span whole nodes of 4 ranks"),
    ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 3},
     "--data-parallel-start-rank", "exceeds --data-parallel-size 4"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "--data-parallel-size-local",
     "exceeds --data-parallel-size 2"),
    ({"data_parallel_size": 4, "nnodes": 2, "node_rank": 1, "data_parallel_size_local": 1},
     "--data-parallel-size-local", "holds 2 data-parallel rank(s), not 1"),
    ({"data_parallel_size": 4, "nnodes": 2, "node_rank": 1, "data_parallel_start_rank": 0},
     "--data-parallel-start-rank", "starts at data-parallel rank 2, not 0"),
    ({"data_parallel_size": 0}, "--data-parallel-size", "must be >= 1"),
    ({"nnodes": 0}, "--nnodes", "must be >= 1"),
])
def test_bad_layouts_name_the_flag(flags, flag, message):
    with pytest.raises(RankLayoutError) as info:
        _layout(**flags).local_ranks()
    assert info.value.flag == flag and message in str(info.value)


def test_bad_flag_combinations_exit_2(ckpt, sock_dir, caplog):
    def run(*args: str) -> tuple[int, str]:
        caplog.clear()
        code = preload.main(["--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                             *args])
        return code, caplog.text

    code, log = run("-tp", "2", "--nnodes", "2", "--node-rank", "2")
    assert code == 2 and "--node-rank: must be between 0 and 1, got 2" in log
    code, log = run("-tp", "3", "--nnodes", "2")
    assert code == 2 and "--nnodes: 2 nodes do not split the world of 3 ranks" in log
    code, log = run("--data-parallel-size", "2", "--data-parallel-start-rank", "1",
                    "--data-parallel-size-local", "2")
    assert code == 2 and "--data-parallel-start-rank: " in log
    too_many = (os.cpu_count() or 1) + 1
    code, log = run("--data-parallel-size", str(too_many))
    assert code == 2 and f"this node would serve {too_many} local ranks" in log
    assert f"--data-parallel-size {too_many}" in log
    # A valid layout still gets the shard-rule check: the TP size, not the local block, splits.
    code, log = run("-tp", "6", "--nnodes", "6", "--node-rank", "5")
    assert code == 2 and "is not divisible" in log
    assert not list(Path(sock_dir).iterdir())  # nothing was started
