"""The ctypes driver binding against cuda-python's on a real device.

On CPU, tests/native/test_libcuda.py checks the binding's layouts against cuda.h and the real
bindings, and its calls over a stand-in driver. Here both bindings call the real driver in
one process: they must name the same device and granularity, and an arena made and exported
through either must map through the other with its bytes whole, zero copy and copy mode. The
whole GPU suite can also run with the ctypes binding chosen for every process
(`WEIGHTCACHE_CUDA_DRIVER=ctypes bash tests/gpu/run_device.sh tests`).
"""

from __future__ import annotations

import os

import pytest
import torch

from weightcache.native.shared import _libcuda, cudadriver, gpu
from weightcache.native.shared.transport import _cuda, cuda_vmm, get_transport

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)


@pytest.fixture
def use(monkeypatch):
    """Switch this process to a binding: the choice made anew, the retained contexts (the
    bindings' CUcontext objects, or ctypes' ints) forgotten."""

    def switch(name: str) -> object:
        monkeypatch.setenv(cudadriver.DRIVER_ENV, name)
        cudadriver.forget()
        monkeypatch.setattr(_cuda, "_primary", {})
        return _cuda.driver()

    yield switch
    cudadriver.forget()
    _cuda._primary.clear()


def test_ctypes_is_chosen_and_agrees_on_the_device(use):
    real = use("bindings")
    assert real is not _libcuda
    uuid_b, gran_b = gpu.device_uuid(0), cuda_vmm.granularity(0)
    assert use("ctypes") is _libcuda
    assert gpu.device_uuid(0) == uuid_b == gpu._torch_uuid(0)
    assert cuda_vmm.granularity(0) == gran_b == 2 << 20
    assert gpu.visible_device_uuids() == [gpu.device_uuid(i)
                                         for i in range(torch.cuda.device_count())]
    err, name = _libcuda.cuGetErrorName(_libcuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    assert err == 0 and name == b"CUDA_ERROR_OUT_OF_MEMORY"


@pytest.mark.parametrize("maker,mapper", [("bindings", "ctypes"), ("ctypes", "bindings"),
                                          ("ctypes", "ctypes")])
def test_an_arena_maps_across_bindings(use, maker, mapper):
    use(maker)
    gran = cuda_vmm.granularity(0)
    nbytes = 3 * gran + 4097
    arena = cuda_vmm.VmmArena(nbytes, 0, count=2)
    pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV)
    arena.tensor().copy_(pattern)
    torch.cuda.synchronize(DEV)
    meta, fds = arena.export()
    assert meta["uuid"] == gpu.device_uuid(0) and len(fds) == 2
    use(mapper)
    transport = get_transport("cuda_vmm")
    zero = transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    assert torch.equal(zero.tensor(), pattern)
    zero.close()
    copier = transport.attach(meta, [os.dup(fd) for fd in fds], DEV)
    block = copier.copy_into(lambda: torch.zeros(nbytes, dtype=torch.uint8, device=DEV), nbytes)
    torch.cuda.synchronize(DEV)
    copier.close()
    assert torch.equal(block, pattern)
    use(maker)
    arena.close()
    assert _cuda.RELEASE_ERRORS == []


def test_a_driver_error_is_named_through_ctypes(use):
    use("ctypes")
    with pytest.raises(_cuda.CudaCallError, match="cuMemAddressFree failed: CUDA_ERROR_"):
        _cuda.check(_libcuda.cuMemAddressFree(0x1000, 4096), "cuMemAddressFree")
