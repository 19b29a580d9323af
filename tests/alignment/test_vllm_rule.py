"""vLLM's own device mapping, run on the CUDA_VISIBLE_DEVICES order the alignment writes.

Needs vLLM's Python sources: tests/conformance/test_alignment_rule.py runs this module in a
child process with each supported version's install on PYTHONPATH (skipped without them).
vllm/platforms/interface.py
imports on CPU; the CUDA platform class needs vLLM's compiled extension, so the one method it
adds for UUIDs (`NvmlCudaPlatform.device_control_id_to_physical_device_id`: NVML's index of
the GPU with that UUID) is answered from the simulated node's table. Everything else is vLLM's
code: `device_id_to_physical_device_id` (entry i of CUDA_VISIBLE_DEVICES) and
`logical_device_id_to_visible_device_id` (what `Worker.init_device` turns into `cuda:<n>`).
Run here with: PYTHONPATH=<vllm 0.33 .py files>:<regex> pytest tests/alignment/test_vllm_rule.py
"""

from __future__ import annotations

import itertools

import pytest

from tests.alignment.test_align import node_map, uuids
from weightcache.contracts import alignment as al

interface = pytest.importorskip("vllm.platforms.interface", reason="vLLM not importable")

PHYSICAL = {u: i for i, u in enumerate(uuids(8))}  # NVML index of each GPU on the node


class NodeCudaPlatform(interface.Platform):
    device_name = "cuda"
    device_type = "cuda"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def device_control_id_to_physical_device_id(cls, device_id: str) -> int:
        return PHYSICAL[device_id]  # NVML: nvmlDeviceGetIndex(nvmlDeviceGetHandleByUUID(id))


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_puts_rank_i_on_a_gpu_holding_shard_i(tp: int, monkeypatch) -> None:
    gpus = node_map(8, tp)
    by_index = {i: u for u, i in PHYSICAL.items()}
    for combo in itertools.combinations(uuids(8), tp):
        a = al.align(list(combo), gpus, tp)
        if a.result != "aligned":
            continue
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(a.order))
        for rank in range(tp):
            visible = NodeCudaPlatform.logical_device_id_to_visible_device_id(rank)
            physical = NodeCudaPlatform.visible_device_id_to_physical_device_id(visible)
            assert visible == rank  # cuda:<rank>
            assert gpus[by_index[physical]].tp_rank == rank


def test_without_alignment_vllm_runs_rank0_of_gpus_1_2_on_gpu_1(monkeypatch) -> None:
    gpus = node_map(8, 2)
    ids = uuids(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{ids[1]},{ids[2]}")  # index order
    physical = NodeCudaPlatform.device_id_to_physical_device_id(0)
    assert gpus[ids[physical]].tp_rank == 1  # rank 0 on a GPU holding tp_rank 1: a miss
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(al.align([ids[1], ids[2]], gpus, 2).order))
    assert gpus[ids[NodeCudaPlatform.device_id_to_physical_device_id(0)]].tp_rank == 0
