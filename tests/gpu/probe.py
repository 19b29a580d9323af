"""An engine stand-in for the GPU tests: attach through the client library, verify, report.

Run as a separate process (optionally inside new namespaces) and print one JSON line:
`{"ok", "pid", "seconds", "verified", "free_delta", "error_type", "error", ...}`.
Exit 0 when attached and verified, 3 when the client refused with a WeightCacheError (the
clear-error path), 1 on anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def _verify(model: str, state: dict, device) -> bool:
    import torch
    from safetensors.torch import load_file

    from weightcache.native.shared.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    for path in ckpt.files:
        for name, tensor in load_file(str(path)).items():
            if not torch.equal(state[name], tensor.to(device)):
                return False
    return True


def _wait_daemon_gone(sock_path: str, timeout: float) -> bool:
    """Open a `watch` connection and wait for the daemon to close it (it exits)."""
    from weightcache.native.shared import protocol as proto

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(sock_path)
        proto.send_frame(s, {"cmd": "watch"})
        reply, _ = proto.recv_frame(s)
        print(json.dumps({"watching": bool(reply.get("ok"))}), flush=True)
        s.settimeout(timeout)
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            return False
        return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--mode", default="zero_copy")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--outlive-daemon", action="store_true")
    args = p.parse_args(argv)
    out: dict = {"pid": os.getpid(), "mode": args.mode}
    try:
        import torch

        from weightcache.native.engine.attach import WeightCacheError, attach

        device = torch.device(args.device)
        torch.cuda.init()
        torch.empty(1, device=device)
        free0, _ = torch.cuda.mem_get_info(device)
        try:
            result = attach(
                args.model, device=device, socket_path=args.socket, mode=args.mode,
                fallback=False,
            )
        except WeightCacheError as exc:
            out.update(ok=False, error_type=type(exc).__name__, error=str(exc))
            print(json.dumps(out), flush=True)
            return 3
        torch.cuda.synchronize(device)
        free1, _ = torch.cuda.mem_get_info(device)
        out.update(
            ok=True, source=result.source, seconds=result.seconds, nbytes=result.nbytes,
            free_delta=free0 - free1,
            verified=_verify(args.model, result.state_dict, device),
        )
        if args.outlive_daemon:
            out["daemon_gone_seen"] = _wait_daemon_gone(args.socket, 120.0)
            time.sleep(0.5)
            out["verified_after_daemon_exit"] = _verify(args.model, result.state_dict, device)
        print(json.dumps(out), flush=True)
        return 0 if out["verified"] and out.get("verified_after_daemon_exit", True) else 1
    except Exception as exc:
        out.update(ok=False, error_type=type(exc).__name__, error=str(exc))
        print(json.dumps(out), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
