"""A real engine process for the multi-node update tests: attach zero_copy, follow updates
behind a `ModelGate`, and keep saying which revision's exact bytes it serves.

Every `--every` seconds, inside the gate (never while paused), it compares each tensor it
maps with each revision as safetensors reads it from disk and writes one JSON status file:
`serving` is the label of the revision every tensor equals, or "torn" when none does. It also
says whether the gate is closed (`paused`), whether it was told `broken`, the generation, and
whether every tensor kept the address it had at attach. Told broken, it does what docs/updates.md
asks of an engine: attach again (with fallback: from disk if the cache cannot serve it).

Fault hooks for the tests: `--pause-sleep S` delays this engine's pause ack (so the other
nodes' PAUSE replies come first), `--pause-kill PID --kill-delay S` kills a process (a daemon)
S seconds after this engine acknowledged the pause, `--finish-kill PID` kills a process the
moment this engine is told its daemon committed (finish), before it resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weightcache.client import ModelGate, follow_updates
from weightcache.native.engine.attach import attach


def reference(ckpt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def serving(state: dict[str, torch.Tensor], refs: dict[str, dict[str, torch.Tensor]]) -> str:
    for label, ref in refs.items():
        if all(n in state and torch.equal(state[n], t) for n, t in ref.items()):
            return label
    return "torn"


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.refs = {label: reference(path) for label, path in args.revision}
        self.gate = ModelGate()
        self.events: list[str] = []
        self.generations: list[int] = []
        self.part: Any = None
        self.broken = ""
        self.reattached = 0
        self.seen: set[str] = set()  # every revision label (or "torn") ever served
        self.model = args.model
        self._attach()

    def _attach(self) -> None:
        self.res = attach(self.model, socket_dir=self.args.socket_dir, mode="zero_copy",
                          fallback=True)
        self.ptrs = {n: t.data_ptr() for n, t in self.res.state_dict.items()}
        self.gate.open()
        self.broken = ""
        self.part = follow_updates(self.res, gate=self.gate, on_pause=self._on_pause,
                                   on_resume=self._on_resume, on_broken=self._on_broken)

    def _on_pause(self) -> None:
        self.events.append("pause")
        if self.args.pause_sleep:
            time.sleep(self.args.pause_sleep)
        if self.args.pause_kill:
            pid, delay = self.args.pause_kill, self.args.kill_delay
            self.args.pause_kill = 0  # once
            threading.Timer(delay, os.kill, (pid, signal.SIGKILL)).start()

    def _on_resume(self, generation: int, changed: bool) -> None:
        if changed and self.args.finish_kill:
            os.kill(self.args.finish_kill, signal.SIGKILL)
            self.args.finish_kill = 0  # once
        self.events.append("finish" if changed else "resumed")
        self.generations.append(generation)

    def _on_broken(self, why: str) -> None:
        self.events.append("broken")
        self.broken = why

    def step(self) -> None:
        if self.broken:
            # The gate stays closed: the bytes cannot be trusted. Reload, as an engine must.
            if self.part is not None:
                self.part.close()
            try:
                self._attach()
                self.reattached += 1
            except Exception as exc:  # the daemon is restarting: try again next step
                self.write({"reattach_error": repr(exc)})
                return
        if self.gate.closed:
            self.write({})
            return
        with self.gate:
            state = self.res.state_dict
            what = serving(state, self.refs)
            same = {n: t.data_ptr() for n, t in state.items()} == self.ptrs
        self.seen.add(what)
        self.write({"serving": what, "addresses_kept": same})

    def write(self, extra: dict[str, Any]) -> None:
        status = {
            "pid": os.getpid(), "source": self.res.source, "paused": self.gate.closed,
            "broken": self.broken, "events": list(self.events),
            "generation": self.part.generation if self.part is not None else None,
            "reattached": self.reattached, "seen": sorted(self.seen), **extra,
        }
        tmp = Path(self.args.status + ".tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(self.args.status)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--socket-dir", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--revision", nargs=2, action="append", metavar=("LABEL", "DIR"),
                   required=True)
    p.add_argument("--every", type=float, default=0.05)
    p.add_argument("--pause-sleep", type=float, default=0.0)
    p.add_argument("--pause-kill", type=int, default=0)
    p.add_argument("--kill-delay", type=float, default=0.2)
    p.add_argument("--finish-kill", type=int, default=0)
    args = p.parse_args(argv)
    engine = Engine(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        engine.step()
        stop.wait(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
