"""Attach A/B on one machine: the daemon and client of two trees, alternated in one run.

    python probe_attach_ab.py BASE=/tmp/basepkg NEW= [--rounds 3] [--per 100]

Each `NAME=DIR` is a tree: DIR holds the `weightcache` package to import (PYTHONPATH), or is
empty for the installed one. Per round and tree, a fresh process starts a real CPU daemon
(`weightcache preload --device cpu`, memfd) of that tree on the demo checkpoint and attaches
through that tree's public client `--per` times each: a new connection and its first `hello`,
a zero_copy attach and a copy attach (plan kept, as an engine's repeat attaches). Prints the
median per round and tree, and the phases (ms) of the last round's attaches.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(tempfile.gettempdir()) / "wc-probe-attach-model"


def worker(per: int) -> None:
    from weightcache import client
    from weightcache.native.shared.connection import connect, recv_reply, send_request
    from weightcache.testing.checkpoints import write_llama_checkpoint

    if not MODEL.exists():
        write_llama_checkpoint(MODEL)
    with tempfile.TemporaryDirectory() as sock_dir:
        os.chmod(sock_dir, 0o700)
        daemon = subprocess.Popen(
            [sys.executable, "-m", "weightcache.cli", "preload", "--model", str(MODEL),
             "--device", "cpu", "--socket-dir", sock_dir],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for line in daemon.stdout:
                if line.startswith("READY"):
                    break
            path = next(Path(sock_dir).glob("*.sock"))
            out: dict[str, list] = {"hello": [], "zero_copy": [], "copy": [],
                                    "zero_copy_phases": [], "copy_phases": []}
            for _ in range(per):
                t0 = time.perf_counter()
                sock = connect(path, timeout=5)
                send_request(sock, "hello")
                recv_reply(sock, "hello")
                out["hello"].append(time.perf_counter() - t0)
                sock.close()
                for mode in ("zero_copy", "copy"):
                    r = client.attach(MODEL, device="cpu", socket_path=path, fallback=False,
                                      mode=mode)
                    assert r.source == "cache"
                    out[mode].append(r.seconds)
                    out[f"{mode}_phases"].append(r.phases)
            print(json.dumps(out))
        finally:
            daemon.terminate()
            daemon.wait()


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        worker(int(argv[1]))
        return
    rounds, per, trees = 3, 100, {}
    it = iter(argv)
    for arg in it:
        if arg == "--rounds":
            rounds = int(next(it))
        elif arg == "--per":
            per = int(next(it))
        else:
            name, _, tree = arg.partition("=")
            trees[name] = tree
    med = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    last: dict[str, dict] = {}
    for r in range(rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=tree)
            raw = subprocess.run([sys.executable, __file__, "--worker", str(per)], env=env,
                                 cwd=tempfile.gettempdir(), capture_output=True, text=True,
                                 check=True).stdout
            data = json.loads(raw.strip().splitlines()[-1])
            last[name] = data
            print(f"round {r + 1} {name}: connect + first hello {med(data['hello'])} ms | "
                  f"zero_copy {med(data['zero_copy'])} ms | copy {med(data['copy'])} ms "
                  f"(median of {per})", flush=True)
    for name, data in last.items():
        for mode in ("zero_copy", "copy"):
            phases = data[f"{mode}_phases"]
            print(f"{name} {mode} phases, ms:",
                  {k: med([p.get(k, 0.0) for p in phases]) for k in phases[-1]})


if __name__ == "__main__":
    main(sys.argv[1:])
