"""A fresh node on the CPU: a cold engine start alone, and beside a cold `weightcache preload`.

    python probe_fresh_node.py [rounds]     (as root: it drops the page cache)

The "engine" is `import torch, transformers; from transformers import LlamaForCausalLM` in a
fresh interpreter (a transformers engine's start before its weights), the daemon the real
`weightcache preload --device cpu` on a 3.15 GB four-file checkpoint at MODEL (written by
`write_llama_checkpoint(MODEL, LlamaShape(hidden=2048, layers=32, intermediate=5632,
vocab=32000, heads=16, kv_heads=4, tied=False), files=4)` if missing). Every cache is dropped
before each step. Per round: the engine alone, the daemon alone (READY), then both started
together with the disk's share as by default, off (`WEIGHTCACHE_LOAD_YIELD=off`) and with every
read of the load at the idle I/O priority (`WEIGHTCACHE_LOAD_IO_PRIORITY=idle`): the engine's
time, READY's, and how long the share was gentle. First, the engine's own I/O when cold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

MODEL = "/var/tmp/wc-fresh/model"
PY = sys.executable
ENGINE = "import torch, transformers; from transformers import LlamaForCausalLM"
IO = """
import time; t = time.perf_counter()
import torch, transformers; from transformers import LlamaForCausalLM
io = dict(l.split(': ') for l in open('/proc/self/io').read().splitlines())
stat = open('/proc/self/stat').read().rsplit(')', 1)[1].split()
print(f"engine alone, cold: {time.perf_counter() - t:.2f} s, {stat[9]} major faults, "
      f"{io['syscr']} read calls, {int(io['read_bytes']) / 1e6:.0f} MB from storage")
"""
VARIANTS = {"default": {}, "yield off": {"WEIGHTCACHE_LOAD_YIELD": "off"},
            "idle io": {"WEIGHTCACHE_LOAD_IO_PRIORITY": "idle"}}


def drop() -> None:
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)


def engine() -> float:
    t = time.perf_counter()
    subprocess.run([PY, "-c", ENGINE], check=True)
    return time.perf_counter() - t


class Daemon:
    def __init__(self, env: dict[str, str]) -> None:
        sock_dir = tempfile.mkdtemp()
        os.chmod(sock_dir, 0o700)
        self.t0 = time.perf_counter()
        self.ready: float | None = None
        self.info: dict = {}
        self.proc = subprocess.Popen(
            [PY, "-m", "weightcache.cli", "preload", "--model", MODEL, "--device", "cpu",
             "--socket-dir", sock_dir], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=dict(os.environ, **env), cwd="/tmp")
        self.reader = threading.Thread(target=self._read)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY"):
                self.ready = time.perf_counter() - self.t0
                self.info = json.loads(line[len("READY"):])
                return

    def wait(self) -> tuple[float | None, float | None]:
        self.reader.join()
        self.proc.terminate()
        self.proc.wait()
        loads = self.info.get("rank_loads") or [{}]
        return self.ready, ((loads[0].get("loader") or {}).get("disk") or {}).get(
            "gentle_seconds")


def main(rounds: int) -> None:
    if not os.path.exists(MODEL):
        from weightcache.testing.checkpoints import LlamaShape, write_llama_checkpoint

        write_llama_checkpoint(MODEL, LlamaShape(hidden=2048, layers=32, intermediate=5632,
                                                 vocab=32000, heads=16, kv_heads=4,
                                                 tied=False), files=4)
    drop()
    subprocess.run([PY, "-c", IO], check=True)
    for _ in range(rounds):
        drop()
        print(f"engine alone: {engine():.2f} s", flush=True)
        drop()
        ready, gentle = Daemon({}).wait()
        print(f"daemon alone: READY {ready:.2f} s (gentle {gentle} s)", flush=True)
        for name, env in VARIANTS.items():
            drop()
            daemon = Daemon(env)
            took = engine()
            ready, gentle = daemon.wait()
            print(f"together, {name}: engine {took:.2f} s, READY {ready:.2f} s, "
                  f"gentle {gentle} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
