"""The update protocol under hostile and confused coordinators (hypothesis, stateful).

A real daemon over its real Unix socket, one engine attached zero_copy and following updates
(it acknowledges pauses, as an engine does), and up to three raw connections driving
`update_stage/pause/write/finish/abort` with real and junk update ids, malformed fields,
out-of-order phases, interleaved connections, connections closed mid-update and requests
from a foreign uid (SO_PEERCRED). After every case, with every connection closed:

- the daemon answers, in bounded time, and settles in `idle` or `broken` (never a phase that
  belongs to a coordinator that is gone);
- the engine is not left paused: its gate is open, unless it was told `broken`;
- `broken` is never silent: a broken rank told the engine, and refuses to serve;
- an idle rank serves exactly the bytes of the model it says it serves (never torn);
- a full update afterwards brings it back (so the next case starts clean).

Engines also register at any point of a case (a late registrant of a broken rank is told).

Example counts: the "ci" profile (a few dozen cases) or HYPOTHESIS_PROFILE=fuzz (`make fuzz`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from weightcache.client import ModelGate, follow_updates
from weightcache.native.engine.attach import attach, query
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.checkpoints import TINY, write_llama_checkpoint
from weightcache.testing.processes import Preload

from .conftest import as_uid, private_dir, raw_connect
from .test_attach import assert_matches, reference
from .test_update import update_here

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
# UPDATE_FUZZ_CASES: another count for one run (the figures in docs/robustness.md).
EXAMPLES = int(os.environ.get("UPDATE_FUZZ_CASES", "1000" if FUZZ else "25"))
CASES = settings(max_examples=EXAMPLES, stateful_step_count=12, deadline=None,
                 suppress_health_check=list(HealthCheck))
COMMANDS = ("update_stage", "update_pause", "update_write", "update_finish", "update_abort")
STATS = {"cases": 0, "steps": 0, "broken": 0, "finished": 0, "failures": 0}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("ufuzz")
    a = write_llama_checkpoint(base / "a", TINY, files=2)
    b = write_llama_checkpoint(base / "b", TINY, files=2, seed=1)
    other = write_llama_checkpoint(base / "other", dataclasses.replace(TINY, layers=1), files=1)
    sockets = private_dir(base / "sockets")
    p = Preload(["--model", str(a), "--weight-cache-socket-dir", str(sockets)])
    try:
        p.wait_ready(120)
        # Hundreds of updates log hundreds of lines: drain them, or the daemon blocks writing
        # its log into a full pipe (while it holds its update lock).
        for stream in (p.proc.stdout, p.proc.stderr):
            threading.Thread(target=lambda s=stream: [None for _ in s], daemon=True).start()
        yield {"a": a, "b": b, "other": other, "sockets": sockets,
               "path": socket_path(sockets, cpu_identity(0)), "refs": {}}
    finally:
        p.stop()


def _ref(world, name: str):
    refs = world["refs"]
    if name not in refs:
        refs[name] = reference(world[name])
    return refs[name]


small = st.integers(-2**63, 2**63 - 1)  # what msgpack encodes
junk = st.one_of(st.none(), st.booleans(), small, st.floats(), st.text(max_size=12),
                 st.binary(max_size=8), st.lists(small, max_size=3),
                 st.dictionaries(st.text(max_size=4), small, max_size=3))


def test_update_protocol_fuzz(world):
    W = world

    class UpdateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            STATS["cases"] += 1
            self.conns: list[socket.socket] = []
            self.ids: list[str] = []
            self.res = attach(W["a"], socket_dir=W["sockets"], fallback=False)
            self.gate = ModelGate()
            self.told: list[str] = []
            self.part = follow_updates(self.res, gate=self.gate, on_broken=self.told.append)
            self.late: list = []  # engines that registered during the case

        @staticmethod
        def _serves() -> str:
            model = query(W["path"], "hello")["update"]["model"]
            return "b" if model == str(W["b"]) else "a"

        def _send(self, i: int, msg: dict) -> dict:
            STATS["steps"] += 1
            sock = self.conns[i % len(self.conns)]
            try:
                proto.send_frame(sock, msg)
                reply, fds = proto.recv_frame(sock, accept_fds=True)
            except (OSError, proto.ProtocolError):
                return {}
            for fd in fds:
                os.close(fd)
            assert isinstance(reply, dict) and "ok" in reply, reply
            if reply.get("ok") and isinstance(reply.get("update"), str):
                self.ids.append(reply["update"])
            return reply

        def _id(self, data) -> object:
            if self.ids and data.draw(st.integers(0, 3)):
                return data.draw(st.sampled_from(self.ids[-3:]))
            return data.draw(st.one_of(st.text(max_size=8), junk))

        @precondition(lambda self: len(self.conns) < 3)
        @rule()
        def open_connection(self) -> None:
            self.conns.append(raw_connect(W["path"], 30))

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2), which=st.sampled_from(["a", "b", "other", "missing", ""]),
              extra=st.dictionaries(st.sampled_from(["source", "model", "force", "x"]), junk,
                                    max_size=2))
        def stage(self, i, which, extra) -> None:
            model = {"missing": "/nonexistent", "": ""}.get(which, str(W.get(which)))
            self._send(i, {"cmd": "update_stage", "source": "checkpoint", "model": model,
                           **(extra if which == "" else {})})

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2), data=st.data(),
              deadline=st.one_of(st.just(5.0), st.just(0.0), st.just(-1), junk),
              force=st.booleans())
        def pause(self, i, data, deadline, force) -> None:
            self._send(i, {"cmd": "update_pause", "update": self._id(data),
                           "deadline_s": deadline, "force": force})

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2), data=st.data(),
              cmd=st.sampled_from(["update_write", "update_finish", "update_abort"]))
        def step(self, i, data, cmd) -> None:
            reply = self._send(i, {"cmd": cmd, "update": self._id(data)})
            if cmd == "update_finish" and reply.get("ok"):
                STATS["finished"] += 1

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2), which=st.sampled_from(["a", "b"]), upto=st.integers(1, 4))
        def drive(self, i, which, upto) -> None:
            """A coordinator's own sequence, cut anywhere: stage, pause, write, finish."""
            reply = self._send(i, {"cmd": "update_stage", "source": "checkpoint",
                                   "model": str(W[which])})
            update = reply.get("update")
            for cmd in ("update_pause", "update_write", "update_finish")[: upto - 1]:
                reply = self._send(i, {"cmd": cmd, "update": update, "deadline_s": 10})
                if cmd == "update_finish" and reply.get("ok"):
                    STATS["finished"] += 1

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2), cmd=st.sampled_from(COMMANDS),
              fields=st.dictionaries(st.text(max_size=8), junk, max_size=4))
        def malformed(self, i, cmd, fields) -> None:
            self._send(i, {**fields, "cmd": cmd})

        @precondition(lambda self: self.conns)
        @rule(i=st.integers(0, 2))
        def close_connection(self, i) -> None:
            self.conns.pop(i % len(self.conns)).close()

        @precondition(lambda self: len(self.late) < 2)
        @rule()
        def register(self) -> None:
            """Another engine registers for updates now, whatever the phase."""
            try:
                self.late.append(follow_updates(self.res, on_broken=self.told.append))
            except Exception as exc:  # refused mid-update is fine; never a hang or a crash
                assert "busy" in str(exc) or "update" in str(exc), exc

        @rule(cmd=st.sampled_from(COMMANDS), data=st.data())
        def foreign_uid(self, cmd, data) -> None:
            update = self._id(data)
            path = str(W["path"])

            def ask() -> dict:
                try:
                    with raw_connect(path, 10) as s:
                        proto.send_frame(s, {"cmd": cmd, "update": update,
                                             "model": str(W["b"])})
                        return {"reply": proto.recv_frame(s)[0].get("ok")}
                except (OSError, proto.ProtocolError):
                    return {"reply": None}  # refused at the door: fine

            assert as_uid(65534, ask)["reply"] is not True

        @invariant()
        def answers(self) -> None:
            assert query(W["path"], "hello", timeout=30)["ok"]

        def teardown(self) -> None:
            try:
                for c in self.conns:
                    c.close()
                self._settle()
            except BaseException:
                STATS["failures"] += 1
                raise
            finally:
                for part in (self.part, *self.late):
                    part.close()

        def _settle(self) -> None:
            deadline = time.monotonic() + 60
            while (phase := query(W["path"], "hello")["update"]["phase"]) not in (
                    "idle", "broken"):
                assert time.monotonic() < deadline, f"left in phase {phase}"
                time.sleep(0.02)
            if phase == "broken":
                STATS["broken"] += 1
                for part in (self.part, *self.late):
                    assert part.wait_for("broken", timeout=30), "broken, an engine not told"
                again = attach(W["a"], socket_dir=W["sockets"])
                assert again.source == "disk" and "broken" in (again.reason or "")
            else:
                t0 = time.monotonic()
                while self.gate.closed and time.monotonic() - t0 < 30:
                    time.sleep(0.02)
                assert not self.gate.closed, "engine left paused"
                name = self._serves()
                got = attach(W[name], socket_dir=W["sockets"], fallback=False)
                assert_matches(got.state_dict, _ref(W, name))
            code, out = update_here(W["sockets"], W["a"])
            assert code == 0, out
            got = attach(W["a"], socket_dir=W["sockets"], fallback=False)
            assert_matches(got.state_dict, _ref(W, "a"))

    run_state_machine_as_test(UpdateMachine, settings=CASES)
    print(f"update fuzz: {STATS}")
