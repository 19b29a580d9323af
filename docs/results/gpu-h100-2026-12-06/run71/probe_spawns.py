"""Which programs start while a rank starts with every cache dropped (the 3-4 faults of an
`ld-linux-x86-64` that made cold READYs gentle for ~1 s): /proc polled every ~2 ms for new
processes (comm, parent chain, cmdline, exe), and Python's audit hooks in the launcher and the
rank for spawns made from Python. A tiny checkpoint: the rank's start is what is looked at."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightcache.native.shared.coldload import drop_page_cache

HOOK = '''
import sys, os, json
def _hook(event, args):
    if event in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                 "ctypes.dlopen"):
        try:
            with open(os.environ["PROBE_AUDIT"], "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "event": event,
                                     "args": repr(args)[:300],
                                     "t": __import__("time").time()}) + "\\n")
        except Exception:
            pass
sys.addaudithook(_hook)
'''


def read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def stat(pid: int) -> tuple[str, int] | None:
    s = read(f"/proc/{pid}/stat")
    if not s:
        return None
    comm = s[s.index("(") + 1 : s.rindex(")")]
    return comm, int(s[s.rindex(")") + 2 :].split()[1])


def poll(seen: dict, stop: threading.Event, before: set[int]) -> None:
    while not stop.is_set():
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            if pid in before or pid in seen:
                continue
            st = stat(pid)
            if st is None:
                continue
            chain, p = [], st[1]
            for _ in range(8):
                ps = stat(p)
                if ps is None:
                    break
                chain.append(f"{ps[0]}:{p}")
                if p <= 1:
                    break
                p = ps[1]
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                exe = ""
            seen[pid] = {"t": time.time(), "comm": st[0], "ppid": st[1], "chain": chain,
                         "cmdline": read(f"/proc/{pid}/cmdline")[:300], "exe": exe}
        time.sleep(0.002)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="probe-spawn-"))
    model = work / "m"
    model.mkdir()
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(16)},
              str(model / "model.safetensors"))
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        with contextlib.suppress(OSError):
            drop_page_cache(sorted(model.glob("*.safetensors")), everything=True)
        audit = work / f"audit{rnd}.jsonl"
        sock = Path(tempfile.mkdtemp(prefix="wc-sock-"))
        os.chmod(sock, 0o700)
        before = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        seen: dict = {}
        stop = threading.Event()
        th = threading.Thread(target=poll, args=(seen, stop, before), daemon=True)
        th.start()
        env = {**os.environ, "PROBE_AUDIT": str(audit),
               "PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.time()
        p = subprocess.Popen([sys.executable, "-m", "weightcache.cli", "preload", "--model",
                              str(model), "--device", os.environ.get("PROBE_DEVICE", "cuda"),
                              "--weight-cache-socket-dir", str(sock)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = None
        for line in p.stdout:
            if line.startswith("READY "):
                ready = json.loads(line[6:])
                break
        t_ready = time.time() - t0
        time.sleep(1.0)
        p.terminate()
        p.wait(30)
        stop.set()
        th.join()
        disk = ((ready or {}).get("rank_loads") or [{}])[0].get("loader", {}).get("disk")
        print(json.dumps({"round": rnd, "ready_s": round(t_ready, 3),
                          "disk_fault_times": (disk or {}).get("fault_times"),
                          "launcher_pid": p.pid}))
        for pid, info in sorted(seen.items(), key=lambda kv: kv[1]["t"]):
            info["t"] = round(info["t"] - t0, 3)
            print("  proc", pid, json.dumps(info))
        for line in (audit.read_text().splitlines() if audit.exists() else []):
            a = json.loads(line)
            a["t"] = round(a["t"] - t0, 3)
            if a["event"] != "ctypes.dlopen" or "ld" in a["args"]:
                print("  audit", json.dumps(a))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
