"""GPU alignment with a real GPU's UUID (marked `gpu`; one GPU is enough).

What only real hardware can show: the UUID string torch reports (the native client's
identity), the one nvidia-smi prints (what the engine-side code reads when
NVIDIA_VISIBLE_DEVICES does not list UUIDs) and the one the agent's map is keyed by are the
same string; and the CUDA driver accepts the UUID form of CUDA_VISIBLE_DEVICES that the
alignment writes, so `cuda:0` in the engine is exactly the GPU the map names (CUDA C
Programming Guide, "CUDA Environment Variables": CUDA_VISIBLE_DEVICES takes GPU UUIDs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from weightcache.contracts import alignment as al
from weightcache.native.engine import rank_devices as native_alignment
from weightcache.native.shared.identity import device_identity

pytestmark = pytest.mark.gpu
OTHER = "GPU-00000000-1111-2222-3333-444444444444"  # a GPU this process does not see


def publish(socket_dir: Path, real: str, real_rank: int) -> None:
    """What the agent publishes: a TP2 cache with the real GPU holding `real_rank`."""
    holdings = [
        al.Holding(uuid=real, tp_rank=real_rank, tp_size=2, dp_rank=0, replica=0,
                   global_rank=real_rank, sockets={"target": f"{real}.sock"}),
        al.Holding(uuid=OTHER, tp_rank=1 - real_rank, tp_size=2, dp_rank=0, replica=0,
                   global_rank=1 - real_rank, sockets={"target": f"{OTHER}.sock"}),
    ]
    socket_dir.mkdir(mode=0o700)
    (socket_dir / al.MAP_NAME).write_text(json.dumps(al.build_map({"tpSize": 2}, holdings)))
    (socket_dir / al.PYTHON_DIR).mkdir()
    (socket_dir / al.PYTHON_DIR / "sitecustomize.py").write_text(al.sitecustomize_source())


@pytest.fixture
def socket_dir():
    root = Path(tempfile.mkdtemp(prefix="wcg", dir="/tmp"))
    yield root / "s"
    shutil.rmtree(root, ignore_errors=True)


def test_torch_nvidia_smi_and_map_agree_on_the_uuid(socket_dir: Path) -> None:
    real = device_identity("cuda", 0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    assert real in [al.canonical(u) for u in al.visible_from_smi(smi)]
    publish(socket_dir, real, 0)
    gpu_map = al.read_map(str(socket_dir))
    assert gpu_map.gpus[real].tp_rank == 0
    # The native client's path: torch's identities -> align -> device index for rank 0.
    assert native_alignment.visible_identities("cuda")[0] == real
    assert native_alignment.rank_devices(2, socket_dir=socket_dir, report=False)[0] == 0
    a = native_alignment.plan(2, socket_dir=socket_dir)
    assert a.order[0] == real and a.ranks[0].hit


def test_engine_interpreter_gets_the_mapped_gpu_as_cuda0(socket_dir: Path) -> None:
    real = device_identity("cuda", 0)
    publish(socket_dir, real, 0)
    probe = ("import json, os, sys, torch\n"
             "from weightcache.native.shared.identity import device_identity\n"
             "json.dump({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), "
             "'count': torch.cuda.device_count(), 'cuda0': device_identity('cuda', 0)}, "
             "open(sys.argv[1], 'w'))\n")
    out = socket_dir.parent / "seen.json"
    drop = ("CUDA_VISIBLE_DEVICES", al.ENV_ACTIVE)  # a fresh container has neither
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({
        "PYTHONPATH": f"{socket_dir / al.PYTHON_DIR}:{env.get('PYTHONPATH', '')}",
        al.ENV_SOCKET_DIR: str(socket_dir), al.ENV_TP: "2", "POD_NAME": "gpu-test",
        # `all` (or indices) makes the engine side ask the real nvidia-smi.
        "NVIDIA_VISIBLE_DEVICES": "all",
        "TMPDIR": str(socket_dir.parent),  # a fresh container's /tmp
    })
    proc = subprocess.run([sys.executable, "-c", probe, str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    print("seen", seen, proc.stderr.strip())
    assert al.canonical(seen["cvd"].split(",")[0]) == real
    assert seen["cuda0"] == real  # the driver honoured the UUID form
    assert "GPU alignment" in proc.stderr
