"""Stand-in for `vllm preload` (vLLM 0.33) that needs no GPU.

It accepts the launcher's flags, spawns one process per local GPU (CUDA_VISIBLE_DEVICES lists
UUIDs, as the agent sets it), and each rank binds vLLM's socket name
(`vllm_weight_cache_<md5(uuid)>[_draft].sock`, 0600, in the socket dir) and answers vLLM's
frames: 8-byte big-endian length + pickle, `get_memory` -> {"status": "ok", "memory_bytes"},
`watch` -> {"status": "ok"} and the connection held open. Like vLLM's launcher, /health on
the health host/port answers 200 once every rank serves and 503 as soon as one has exited,
and SIGTERM terminates every rank.

FAKE_VLLM_LOAD_S delays binding; FAKE_VLLM_REPLY=evil|huge|error makes get_memory misbehave;
FAKE_VLLM_ARGS_OUT writes the argv it got as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LEN = struct.Struct("!Q")
DRAFT_METHODS = {"mtp", "eagle", "eagle3"}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/weightcache-fake-vllm-pwned",))


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError
        buf += chunk
    return buf


def _send(conn: socket.socket, obj: object) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    conn.sendall(LEN.pack(len(payload)) + payload)


def serve_rank(path: str, nbytes: int) -> None:
    watchers = []
    reply_mode = os.environ.get("FAKE_VLLM_REPLY", "")

    def stop(signum, frame):
        if os.path.exists(path):
            os.unlink(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    time.sleep(float(os.environ.get("FAKE_VLLM_LOAD_S", "0")))
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound and listening under a temporary name, then renamed into place: a client that sees
    # the path can connect (between bind and listen it was refused, a flaky test).
    staging = f"{path}.{os.getpid()}"
    server.bind(staging)
    os.chmod(staging, 0o600)
    server.listen()
    os.rename(staging, path)
    while True:
        conn, _ = server.accept()
        try:
            (length,) = LEN.unpack(_recv_exact(conn, LEN.size))
            request = pickle.loads(_recv_exact(conn, length))
            cmd = request.get("cmd")
            if cmd == "get_memory":
                if reply_mode == "evil":
                    _send(conn, {"status": "ok", "memory_bytes": _Evil()})
                elif reply_mode == "huge":
                    conn.sendall(LEN.pack(1 << 40))
                elif reply_mode == "error":
                    _send(conn, {"status": "error", "message": "boom"})
                else:
                    _send(conn, {"status": "ok", "memory_bytes": nbytes})
            elif cmd == "watch":
                watchers.append(conn.dup())
                _send(conn, {"status": "ok"})
            else:
                _send(conn, {"status": "error", "message": f"Unknown command {cmd!r}"})
        except (ConnectionError, OSError, pickle.UnpicklingError):
            pass
        finally:
            conn.close()


def main() -> int:
    if sys.argv[1:2] == ["--rank-server"]:
        serve_rank(sys.argv[2], int(sys.argv[3]))
        return 0
    if sys.argv[1:2] != ["preload"]:
        print("fake vllm: only `preload` is supported", file=sys.stderr)
        return 2
    if os.environ.get("FAKE_VLLM_ARGS_OUT"):
        with open(os.environ["FAKE_VLLM_ARGS_OUT"], "w") as f:
            json.dump(sys.argv[1:], f)
    if os.environ.get("FAKE_VLLM_ENV_OUT"):
        with open(os.environ["FAKE_VLLM_ENV_OUT"], "w") as f:
            json.dump(dict(os.environ), f)
    if os.environ.get("FAKE_VLLM_AUTOTUNE") and os.environ.get("VLLM_CACHE_ROOT"):
        # Like vLLM's warmup: the per-rank table is written only when it had to tune.
        table = os.path.join(os.environ["VLLM_CACHE_ROOT"], "flashinfer_autotune_cache",
                             "0.7.2.post1", "90a", "c" * 64, "autotune_configs_dp0_rank0.json")
        if not os.path.exists(table):
            os.makedirs(os.path.dirname(table), exist_ok=True)
            with open(table, "w") as f:
                json.dump({"_metadata": {}, "tactics": [1, 2, 3]}, f)
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--speculative-config")
    p.add_argument("--weight-cache-socket-dir", required=True)
    p.add_argument("--weight-cache-health-host", default="0.0.0.0")
    p.add_argument("--weight-cache-health-port", type=int)
    args, _ = p.parse_known_args(sys.argv[2:])
    uuids = [u for u in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
    roles = [""]
    if args.speculative_config:
        method = json.loads(args.speculative_config).get("method", "")
        if method in DRAFT_METHODS or method.endswith("_mtp"):
            roles.append("_draft")
    procs = []
    for role in roles:
        for u in uuids:
            name = f"vllm_weight_cache_{hashlib.md5(u.encode()).hexdigest()}{role}.sock"
            path = os.path.join(args.weight_cache_socket_dir, name)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--rank-server", path, str(1 << 20)]))
    load_s = float(os.environ.get("FAKE_VLLM_LOAD_S", "0"))
    started = time.monotonic()

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = time.monotonic() - started >= load_s and all(p.poll() is None for p in procs)
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    if args.weight_cache_health_port is not None:
        httpd = ThreadingHTTPServer((args.weight_cache_health_host, args.weight_cache_health_port),
                                    Health)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def shutdown(signum, frame):
        # Like vLLM's launcher: terminate every rank; the main thread joins them.
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print("===== Weight cache daemon READY (fake) =====", flush=True)
    for proc in procs:
        proc.wait()
    return max(proc.returncode or 0 for proc in procs)


if __name__ == "__main__":
    sys.exit(main())
