"""Where a new process's first attach spends its time on CUDA (prints JSON and profiles).

In run100 an engine's first attach of the 291-tensor 16 GB shard took 29.6-55.7 ms on an H100,
of which the plan (`expect_rank`) 21-28 ms, against 2.2 ms for the same plan on CPU. The plan
on CUDA first asks the driver for the device's UUID, which imports `cuda.bindings.driver`.
This probe serves the bench's shard (sparse, `_served_shard`) and runs new processes, each with
torch imported and the CUDA context made off the clock, as an engine's restart has them:

- `driver`: the driver bindings' import, `cuInit`, `cuDeviceGetUuid`, against `ctypes` opening
  the driver torch already loaded, the ctypes binding's import, load and the same two calls,
  and torch's own UUID of the device;
- `first`: the first zero-copy attach, as the bench's `fresh` part times it;
- `first_preloaded`: the same with the bindings imported and the UUID asked for off the clock,
  so the difference to `first` is what those cost on the attach's clock;
- `first_ctypes`: the first attach with the ctypes driver binding chosen
  (`WEIGHTCACHE_CUDA_DRIVER=ctypes`: `native/shared/cudadriver.py`);
- `profile`: the first attach under cProfile (its top functions by cumulative time).

Run: `python3 tests/gpu/probe_first_attach.py` on the device (run_device.sh
probe_first_attach); PROBE_ROUNDS (default 4) rounds of the timed ways in turn; PROBE_DEVICE=cpu
runs the attach ways on memfd (a check of the probe itself).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from weightcache.bench.attach import _served_shard, child_result

CHILD = r"""
import json, sys, time
import torch
model, sock, what, device = sys.argv[1:5]
cuda = device.startswith("cuda")
sync = torch.cuda.synchronize if cuda else (lambda: None)
torch.empty(1, device=device); sync()
out = {}
def ms(t):
    return round((time.perf_counter() - t) * 1e3, 3)
if what == "driver":
    t = time.perf_counter(); import ctypes; lib = ctypes.CDLL("libcuda.so.1")
    out["ctypes_open_ms"] = ms(t)
    t = time.perf_counter(); str(torch.cuda.get_device_properties(0).uuid)
    out["torch_uuid_ms"] = ms(t)
    t = time.perf_counter(); from cuda.bindings import driver as cu
    out["import_bindings_ms"] = ms(t)
    t = time.perf_counter(); cu.cuInit(0); out["cuInit_ms"] = ms(t)
    t = time.perf_counter(); dev = cu.cuDeviceGet(0)[1]; cu.cuDeviceGetUuid(dev)
    out["uuid_ms"] = ms(t)
    t = time.perf_counter(); from weightcache.native.shared import _libcuda
    out["import_libcuda_ms"] = ms(t)
    t = time.perf_counter(); _libcuda.load(); out["libcuda_load_ms"] = ms(t)
    t = time.perf_counter(); _libcuda.cuInit(0); dev = _libcuda.cuDeviceGet(0)[1]
    raw = _libcuda.cuDeviceGetUuid(dev)[1].bytes; out["libcuda_init_uuid_ms"] = ms(t)
    from weightcache.native.shared.gpu import device_uuid, uuid_from_bytes
    out["libcuda_uuid"] = uuid_from_bytes(raw)
    out["torch_uuid"] = str(torch.cuda.get_device_properties(0).uuid)
    out["our_uuid"] = device_uuid(0)
else:
    from weightcache.client import attach
    if what == "first_preloaded" and cuda:
        from weightcache.native.shared.gpu import device_uuid
        from weightcache.native.shared.transport import _cuda
        _cuda.driver(); device_uuid(0)
    if what == "profile":
        import cProfile, io, pstats
        prof = cProfile.Profile(); prof.enable()
    t = time.perf_counter()
    res = attach(model, device=device, socket_path=sock, mode="zero_copy", fallback=False)
    sync()
    out["first_ms"] = ms(t)
    if what == "profile":
        prof.disable(); s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        out["profile"] = s.getvalue()
    out["phases_ms"] = {k: round(v * 1e3, 3) for k, v in res.phases.items()}
    out["source"] = res.source
print("RESULT " + json.dumps(out))
"""


def _child(model: Path, sock: str, what: str, device: str) -> dict[str, Any]:
    env = dict(os.environ)
    if what == "first_ctypes":
        env["WEIGHTCACHE_CUDA_DRIVER"] = "ctypes"
    return child_result(CHILD, [str(model), sock, what, device], env, what)


def main() -> None:
    rounds = int(os.environ.get("PROBE_ROUNDS", "4"))
    device = os.environ.get("PROBE_DEVICE", "cuda")
    ways = ("first", "first_preloaded", "first_ctypes") + (
        ("driver",) if device.startswith("cuda") else ())
    out: dict[str, Any] = {"rounds": rounds}
    with tempfile.TemporaryDirectory(dir=os.environ.get("PROBE_DIR")) as work, \
            _served_shard(Path(work), "shard", device, False) as (model, daemon):
        got: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
        for r in range(rounds):
            for w in ways[r % len(ways):] + ways[:r % len(ways)]:
                got[w].append(_child(model, daemon.socket, w, device))
        for w in ("first", "first_preloaded", "first_ctypes"):
            firsts = [x["first_ms"] for x in got[w]]
            out[w] = {"first_ms": firsts, "median_ms": statistics.median(firsts),
                      "sources": sorted({x["source"] for x in got[w]}),
                      "plan_ms": [x["phases_ms"].get("plan") for x in got[w]],
                      "phases_ms_median_run": got[w][
                          firsts.index(sorted(firsts)[len(firsts) // 2])]["phases_ms"]}
        out["driver"] = got.get("driver", [])
        prof = _child(model, daemon.socket, "profile", device)
        out["profile_first_ms"] = prof["first_ms"]
        print(prof["profile"])
    text = json.dumps(out, indent=1)
    print(text)
    if os.environ.get("PROBE_OUT"):
        Path(os.environ["PROBE_OUT"]).write_text(text + "\n")


if __name__ == "__main__":
    main()
