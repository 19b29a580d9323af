"""In-place updates: real daemon processes, real sockets, the real client and `weightcache update`.

What is asserted is what an engine relies on: the tensors it mapped keep their addresses and
show the new checkpoint's bytes after `finish`; nothing changes before it; a refused or
aborted update leaves the old generation serving; a torn arena is refused, never served.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from weightcache.client import ModelGate, follow_updates, push_update
from weightcache.native.coordinator import UpdateError, discover, update_group
from weightcache.native.engine.attach import attach, query
from weightcache.native.shared import protocol as proto
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.checkpoints import TINY, LlamaShape, write_llama_checkpoint
from weightcache.testing.processes import weightcache_cmd

from .conftest import as_uid, raw_connect
from .test_attach import assert_matches, reference
from .test_security import needs_root

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same layout as `ckpt` (seed 0), other weights: a fine-tune with identical headers."""
    return write_llama_checkpoint(tmp_path_factory.mktemp("b") / "tiny", TINY, files=2, seed=1)


def run_update(*args: str) -> tuple[int, dict, str]:
    """`weightcache update` as a process: (exit code, its JSON line, stderr)."""
    out = subprocess.run([*weightcache_cmd(), "update", *args], capture_output=True, text=True,
                         check=False, timeout=120)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stderr
    return out.returncode, json.loads(lines[-1]), out.stderr


def update_here(sock_dir: Path, model: Path, **options) -> tuple[int, dict]:
    """What `weightcache update` does, in this process (saves an interpreter start)."""
    try:
        return 0, update_group(discover(sock_dir), model=str(model), **options)
    except UpdateError as exc:
        return 1, {"error": exc.code, "message": str(exc), "broken": exc.broken, **exc.detail}


@pytest.fixture
def daemon(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    p.wait_ready(120)
    return socket_path(sock_dir, cpu_identity(0))


def test_update_in_place_keeps_addresses_and_switches_identity(daemon, ckpt, ckpt_b, sock_dir):
    res = attach(ckpt, socket_dir=sock_dir, mode="zero_copy", fallback=False)
    assert res.source == "cache" and res.generation == 1
    ptrs = {n: t.data_ptr() for n, t in res.state_dict.items()}
    gate, resumed = ModelGate(), []
    part = follow_updates(res, gate=gate, on_resume=lambda g, c: resumed.append((g, c)))
    try:
        code, out, _ = run_update("--model", str(ckpt_b), "--socket-dir", str(sock_dir))
        assert code == 0, out
        assert out["generation"] == 2 and out["engines_paused"] == 1 and out["ranks"] == 1
        assert out["bytes"] == res.nbytes and out["forced_engines"] == []
        # Same addresses, new bytes: what a captured CUDA graph replays after the update.
        assert {n: t.data_ptr() for n, t in res.state_dict.items()} == ptrs
        assert_matches(res.state_dict, reference(ckpt_b))
        assert part.wait_for("finish")  # events are handled on the participant's thread
        assert resumed == [(2, True)] and part.generation == 2 and not gate.closed
        assert [e["event"] for e in part.events] == ["begin", "finish"]
        assert part.events[1]["identity"]["content"] == out["identity"]["content"]
    finally:
        part.close()
    # New engines asking for the new checkpoint hit; the old one is no longer what is served.
    new = attach(ckpt_b, socket_dir=sock_dir, fallback=False)
    assert new.source == "cache" and new.generation == 2
    assert_matches(new.state_dict, reference(ckpt_b))
    old = attach(ckpt, socket_dir=sock_dir)
    assert old.source == "disk" and "content" in (old.reason or "")
    assert_matches(old.state_dict, reference(ckpt))
    stats = query(daemon, "stats")
    assert stats["updates"]["generation"] == 2 and stats["updates"]["results"] == {"ok": 1}
    assert stats["updates"]["pause_seconds"]["count"] == 1


def test_same_path_rewritten_updates_and_matches(daemon, ckpt, sock_dir, tmp_path):
    # The daemon serves a copy; rewriting that directory in place is "the same path rewritten".
    import shutil

    path = tmp_path / "rewritten"
    shutil.copytree(ckpt, path)
    code, out = update_here(sock_dir, path)
    assert code == 0 and out["generation"] == 2
    assert out["stage_phases"]["rollback_source"] == "files", out  # `ckpt` holds generation 1
    assert attach(path, socket_dir=sock_dir, fallback=False).source == "cache"
    write_llama_checkpoint(path, TINY, files=2, seed=2)  # rewrite: same headers, new bytes
    assert attach(path, socket_dir=sock_dir).source == "disk"  # stale cache is never served
    # This process attached zero_copy above without a participant: the update needs --force.
    code, out = update_here(sock_dir, path, force=True)
    assert code == 0 and out["generation"] == 3 and out["forced_engines"] == [os.getpid()]
    # Generation 2's files now hold other bytes: they must not be the rollback source.
    assert out["stage_phases"]["rollback_source"] == "device"
    res = attach(path, socket_dir=sock_dir, fallback=False)
    assert res.source == "cache" and res.generation == 3
    assert_matches(res.state_dict, reference(path))


def test_a_staged_file_written_before_the_write_is_refused(daemon, ckpt, ckpt_b, sock_dir,
                                                         tmp_path):
    """Staged from the files' own pages: a file written after it was verified is never copied
    into the arena; the write is refused before its first byte and engines resume unchanged."""
    import shutil

    path = tmp_path / "b"
    shutil.copytree(ckpt_b, path)
    res = attach(ckpt, socket_dir=sock_dir, mode="zero_copy", fallback=False)
    part = follow_updates(res)
    try:
        with raw_connect(daemon, 30) as c:
            update = _stage(c, path)
            assert _call(c, "update_pause", update=update)["paused"] == 1
            victim = sorted(path.glob("*.safetensors"))[0]
            with open(victim, "r+b") as f:  # the same byte back: the file was still written
                first = f.read(1)
                f.seek(0)
                f.write(first)
            refused = _call(c, "update_write", update=update)
            assert refused["error"] == proto.E_BAD_REQUEST
            assert "written since it was staged" in refused["message"]
            assert "stage the update again" in refused["message"]
            out = _call(c, "update_abort", update=update)
            assert out["phase"] == "idle" and out["generation"] == 1
        assert part.wait_for("resumed")
    finally:
        part.close()
    assert_matches(res.state_dict, reference(ckpt))
    assert query(daemon, "hello")["update"]["generation"] == 1


def test_layout_mismatch_is_refused_naming_tensors(daemon, ckpt, sock_dir, tmp_path):
    shape = LlamaShape(hidden=TINY.hidden, layers=TINY.layers, intermediate=TINY.intermediate,
                       vocab=TINY.vocab * 2, heads=TINY.heads, kv_heads=TINY.kv_heads)
    other = write_llama_checkpoint(tmp_path / "bigger-vocab", shape, files=2)
    code, out, err = run_update("--model", str(other), "--socket-dir", str(sock_dir))
    assert code == 1 and out["error"] == proto.E_LAYOUT_MISMATCH and not out["broken"]
    # docs/cli.md: one line on stderr, no traceback.
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("weightcache update: ") and "a restart is needed" in err
    assert "model.embed_tokens.weight" in out["tensors"]
    assert "model.embed_tokens.weight" in out["message"]
    assert query(daemon, "hello")["update"]["generation"] == 1
    assert attach(ckpt, socket_dir=sock_dir, fallback=False).source == "cache"


def test_unpausable_engine_refuses_unless_forced(daemon, ckpt, ckpt_b, sock_dir):
    res = attach(ckpt, socket_dir=sock_dir, mode="zero_copy", fallback=False)  # no participant
    code, out = update_here(sock_dir, ckpt_b)
    assert code == 1 and out["error"] == proto.E_UNPAUSABLE
    assert str(os.getpid()) in out["message"]
    assert out["engines"][0]["pid"] == os.getpid()
    assert_matches(res.state_dict, reference(ckpt))  # nothing was written
    code, out = update_here(sock_dir, ckpt_b, force=True)
    assert code == 0 and out["forced_engines"] == [os.getpid()]
    assert_matches(res.state_dict, reference(ckpt_b))


def test_pause_deadline_aborts_and_engines_resume_old(daemon, ckpt, ckpt_b, sock_dir):
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    release, resumed = threading.Event(), []
    part = follow_updates(res, on_pause=lambda: release.wait(30),
                          on_resume=lambda g, c: resumed.append((g, c)))
    try:
        code, out = update_here(sock_dir, ckpt_b, pause_deadline_s=0.5)
        assert code == 1 and out["error"] == proto.E_PAUSE_TIMEOUT and not out["broken"]
        assert str(os.getpid()) in out["message"]
        release.set()
        assert part.wait_for("resumed")
        assert_matches(res.state_dict, reference(ckpt))
        assert query(daemon, "hello")["update"] == {**query(daemon, "hello")["update"],
                                                     "generation": 1, "phase": "idle"}
    finally:
        part.close()
    assert [e["event"] for e in part.events] == ["begin", "resumed"]
    assert resumed == [(1, False)]


def test_push_from_trainer_switches_without_checkpoint(daemon, ckpt, ckpt_b, sock_dir):
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    part = follow_updates(res)
    new = {n: t.clone() for n, t in reference(ckpt_b).items()}
    try:
        out = push_update({str(daemon): new})
    finally:
        part.close()
    assert out["generation"] == 2 and out["source"] == "push" and out["engines_paused"] == 1
    assert out["identity"]["content"].startswith("push:sha256:")
    assert_matches(res.state_dict, new)
    # The served bytes are no checkpoint on disk: both checkpoints now load from disk.
    assert attach(ckpt, socket_dir=sock_dir).source == "disk"
    assert attach(ckpt_b, socket_dir=sock_dir).source == "disk"
    bad = {**new, NORM: torch.zeros(3, dtype=torch.bfloat16)}
    with pytest.raises(Exception, match=NORM):
        push_update({str(daemon): bad})
    assert query(daemon, "hello")["update"]["generation"] == 2


def _stage(sock, model: Path, **fields) -> str:
    proto.send_frame(sock, {"cmd": "update_stage", "source": "checkpoint", "model": str(model),
                            **fields})
    reply, _ = proto.recv_frame(sock)
    assert reply["ok"], reply
    return reply["update"]


def wait_phase(path: Path, phase: str) -> None:
    """The daemon notices a closed connection on its own thread: wait for it (bounded)."""
    deadline = time.monotonic() + 60
    while query(path, "hello")["update"]["phase"] != phase:
        assert time.monotonic() < deadline, f"daemon never reached phase {phase}"
        time.sleep(0.02)


def _call(sock, cmd: str, **fields) -> dict:
    proto.send_frame(sock, {"cmd": cmd, **fields})
    return proto.recv_frame(sock)[0]


def test_protocol_phases_and_ownership(daemon, ckpt, ckpt_b, sock_dir):
    a, b = raw_connect(daemon, 30), raw_connect(daemon, 30)
    try:
        assert _call(a, "update_pause", update="nope")["error"] == proto.E_UPDATE_STATE
        update = _stage(a, ckpt_b)
        # One update at a time; only its connection drives it.
        assert _call(b, "update_stage", model=str(ckpt_b))["error"] == proto.E_UPDATE_STATE
        assert _call(b, "update_pause", update=update)["error"] == proto.E_UPDATE_STATE
        assert _call(a, "update_write", update=update)["error"] == proto.E_UPDATE_STATE
        assert _call(a, "update_pause", update=update, deadline_s=-1)["error"] == (
            proto.E_BAD_REQUEST)
        # fds ride only on update_stage.
        r, w = os.pipe()
        proto.send_frame(b, {"cmd": "hello"}, [r])
        os.close(r), os.close(w)
        assert proto.recv_frame(b)[0]["error"] == proto.E_BAD_FRAME
    finally:
        b.close()
        a.close()  # the coordinator went away: its staged update is dropped
    wait_phase(daemon, "idle")
    c = raw_connect(daemon, 30)
    try:
        update = _stage(c, ckpt_b)  # accepted: the slot was freed
        assert _call(c, "update_abort", update=update)["phase"] == "idle"
    finally:
        c.close()
    assert attach(ckpt, socket_dir=sock_dir, fallback=False).source == "cache"


def test_abort_after_write_rolls_back_at_the_same_addresses(daemon, ckpt, ckpt_b, sock_dir):
    """The daemon kept a host copy of generation 1 at stage: an abort after the write (another
    rank or node failed) writes it back into the same memory and resumes engines unchanged."""
    res = attach(ckpt, socket_dir=sock_dir, mode="zero_copy", fallback=False)
    ptrs = {n: t.data_ptr() for n, t in res.state_dict.items()}
    gate, resumed = ModelGate(), []
    part = follow_updates(res, gate=gate, on_resume=lambda g, c: resumed.append((g, c)))
    try:
        with raw_connect(daemon, 30) as c:
            proto.send_frame(c, {"cmd": "update_stage", "source": "checkpoint",
                                 "model": str(ckpt_b)})
            staged = proto.recv_frame(c)[0]
            assert staged["rollback"] is True and staged["rollback_why"] == ""
            # Where staging's time went; the rollback source is made ready beside the read.
            phases = staged["phases"]
            assert {"allocate_seconds", "read_seconds", "rollback_seconds"} <= set(phases)
            assert phases["read_gb_per_s"] > 0 and phases["rollback_seconds"] > 0
            # The new bytes are the files' own pages; generation 1's files are unchanged and
            # cached, so they are the rollback source (no copy of the arena).
            assert phases["staging"] == "files" and phases["rollback_source"] == "files"
            update = staged["update"]
            assert _call(c, "update_pause", update=update)["paused"] == 1
            assert _call(c, "update_write", update=update)["ok"]
            assert_matches(res.state_dict, reference(ckpt_b))  # written, not yet finished
            out = _call(c, "update_abort", update=update)
            assert out["rolled_back"] is True and out["phase"] == "idle"
            assert out["generation"] == 1
        assert part.wait_for("resumed")
    finally:
        part.close()
    assert resumed == [(1, False)] and not gate.closed
    assert part.events[-1].get("rolled_back") is True
    assert {n: t.data_ptr() for n, t in res.state_dict.items()} == ptrs
    assert_matches(res.state_dict, reference(ckpt))
    hello = query(daemon, "hello")["update"]
    assert hello["phase"] == "idle" and hello["generation"] == 1 and not hello["broken"]
    assert query(daemon, "stats")["updates"]["results"] == {"rolled_back": 1}
    again = attach(ckpt, socket_dir=sock_dir, fallback=False)
    assert again.source == "cache" and again.generation == 1
    assert_matches(again.state_dict, reference(ckpt))


def test_abort_after_write_marks_broken_until_a_full_update(daemon, ckpt, ckpt_b, sock_dir):
    """Without a rollback copy (`rollback: off`, or host memory did not allow it)."""
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    broken: list[str] = []
    part = follow_updates(res, on_broken=broken.append)
    try:
        with raw_connect(daemon, 30) as c:
            update = _stage(c, ckpt_b, rollback="off")
            assert _call(c, "update_pause", update=update)["paused"] == 1
            assert _call(c, "update_write", update=update)["ok"]
            assert _call(c, "update_abort", update=update)["phase"] == "broken"
        assert part.wait_for("broken")
        assert broken and "aborted after the write" in broken[0]
        # A torn arena is never served: both checkpoints load from disk, with the reason.
        for model in (ckpt, ckpt_b):
            again = attach(model, socket_dir=sock_dir)
            assert again.source == "disk" and "broken" in (again.reason or "")
        assert query(daemon, "hello")["update"]["phase"] == "broken"
        with raw_connect(daemon, 30) as c:  # a broken rank has no whole generation to keep
            proto.send_frame(c, {"cmd": "update_stage", "source": "checkpoint",
                                 "model": str(ckpt_b), "rollback": "require"})
            refused = proto.recv_frame(c)[0]
        assert refused["error"] == proto.E_NO_ROLLBACK and "broken" in refused["message"]
        code, out = update_here(sock_dir, ckpt_b)
        assert code == 0 and out["generation"] == 2
        assert part.wait_for("finish")
    finally:
        part.close()
    assert [e["event"] for e in part.events] == ["begin", "broken", "begin", "finish"]
    fixed = attach(ckpt_b, socket_dir=sock_dir, fallback=False)
    assert_matches(fixed.state_dict, reference(ckpt_b))
    assert_matches(res.state_dict, reference(ckpt_b))


def test_group_switches_all_ranks_or_none(ckpt, ckpt_b, sock_dir, preload):
    preload("--model", str(ckpt), "--tensor-parallel-size", "2",
            "--weight-cache-socket-dir", str(sock_dir)).wait_ready(120)
    assert len(discover(sock_dir)) == 2
    ranks = [attach(ckpt, socket_dir=sock_dir, tp_size=2, tp_rank=r, fallback=False)
             for r in (0, 1)]
    parts = [follow_updates(r) for r in ranks]
    # Rank 1's engine never acknowledges: neither rank switches.
    release = threading.Event()
    stuck = follow_updates(ranks[1], on_pause=lambda: release.wait(30))
    try:
        code, out = update_here(sock_dir, ckpt_b, pause_deadline_s=0.5)
        assert code == 1 and out["error"] == proto.E_PAUSE_TIMEOUT
        for r in (0, 1):
            assert query(socket_path(sock_dir, cpu_identity(r)), "hello")["update"][
                "generation"] == 1
        release.set()
        stuck.close()
        code, out = update_here(sock_dir, ckpt_b)
        assert code == 0 and out["ranks"] == 2 and out["generation"] == 2
        assert out["engines_paused"] == 2
    finally:
        for p in parts:
            p.close()
    for r, res in enumerate(ranks):
        disk = attach(ckpt_b, socket_dir=sock_dir, tp_size=2, tp_rank=r, fallback=False)
        assert disk.source == "cache"
        assert_matches(res.state_dict, disk.state_dict)


EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "live_update.py"


def test_documented_example_keeps_addresses_and_serves_new_model(daemon, ckpt, ckpt_b, sock_dir):
    """docs/examples/live_update.py without a CUDA graph: eager outputs are the new model's."""
    import sys

    out = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(ckpt), "--new-model",
                          str(ckpt_b), "--socket-dir", str(sock_dir)],
                         capture_output=True, text=True, check=False, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (report, out.stderr[-2000:])
    assert report["addresses_kept"] and report["outputs_changed"] and report["equals_new_model"]
    assert report["update"]["generation"] == 2 and report["update"]["engines_paused"] == 1
    assert report["resumed"] == [[2, True]] and report["graph"] is False


@needs_root
def test_engines_of_other_uids_cannot_update(ckpt, ckpt_b, sock_dir, preload):
    """An allowed engine uid may read the cache and its table, never rewrite it (SO_PEERCRED).

    As in test_security: the child's effective uid (what SO_PEERCRED reports) is nobody's, its
    filesystem uid stays root's so the socket file lets it through."""
    nobody = 65534
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                "--weight-cache-allow-uid", str(nobody))
    sock = p.wait_ready(120)["sockets"][0]

    def try_update() -> list[dict]:
        with raw_connect(sock) as s:
            replies = [_call(s, "update_stage", model=str(ckpt_b)), _call(s, "get_table")]
        return [{k: x.get(k) for k in ("ok", "error", "message")} for x in replies]

    stage, table = as_uid(nobody, try_update)
    assert stage["error"] == proto.E_PERMISSION_DENIED and "reserved to uid 0" in stage["message"]
    assert table["ok"] is True
    assert query(sock, "hello")["update"] == {**query(sock, "hello")["update"], "phase": "idle",
                                              "generation": 1}


def test_daemon_gone_mid_update_keeps_the_engine_stopped(daemon, ckpt, ckpt_b, sock_dir):
    """Between begin and finish the bytes may be half written: a vanished daemon is broken."""
    import signal

    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    gate, broken = ModelGate(), []
    part = follow_updates(res, gate=gate, on_broken=broken.append)
    try:
        with raw_connect(daemon, 30) as c:
            update = _stage(c, ckpt_b)
            assert _call(c, "update_pause", update=update)["paused"] == 1
            os.kill(query(daemon, "hello")["pid"], signal.SIGKILL)
            assert part.wait_for("broken")
    finally:
        part.close()
    assert gate.closed and broken and "during an update" in broken[0]


def test_a_copy_that_overlapped_an_update_is_not_kept(daemon, ckpt, ckpt_b, sock_dir):
    """Copy-mode engines are not paused by an update, so a copy that overlapped a write would
    hold two revisions at once. After copying, the client asks the daemon again: the copy is
    whole only if the generation `get_state` served is still served and no write is under way
    (`_check_unchanged`, on the real daemon's `hello`)."""
    from weightcache.native.engine.attach import (
        CacheProtocolError,
        _check_unchanged,
        _check_unchanged_after_copy,
    )

    res = attach(ckpt, socket_dir=sock_dir, mode="copy", fallback=False)
    assert res.source == "cache" and res.generation == 1
    engine, coordinator = raw_connect(daemon, 30), raw_connect(daemon, 30)
    try:
        _check_unchanged(engine, 1)  # nothing happened: the copy stands
        update = _stage(coordinator, ckpt_b)
        _check_unchanged(engine, 1)  # staged only: the arena still holds generation 1
        assert _call(coordinator, "update_pause", update=update)["ok"]
        with pytest.raises(CacheProtocolError, match="updated while this engine copied"):
            _check_unchanged(engine, 1)  # a write may be running
        assert _call(coordinator, "update_write", update=update)["ok"]
        assert _call(coordinator, "update_finish", update=update)["ok"]
        with pytest.raises(CacheProtocolError, match="generation 1 -> 2"):
            _check_unchanged(engine, 1)  # the copy began before the write: torn
        _check_unchanged(engine, 2)
        # What a copy-mode attach runs: the question is sent, the mapping released while the
        # daemon answers (once), then the answer read; on a dead connection, asked anew.
        released: list[int] = []
        kw = dict(connect_timeout_s=5.0, state_timeout_s=5.0,
                  meanwhile=lambda: released.append(1))
        _check_unchanged_after_copy(engine, time.monotonic(), daemon, 2, **kw)
        with pytest.raises(CacheProtocolError, match="generation 1 -> 2"):
            _check_unchanged_after_copy(engine, time.monotonic(), daemon, 1, **kw)
        dead = raw_connect(daemon, 30)
        dead.shutdown(socket.SHUT_RDWR)
        with pytest.raises(CacheProtocolError, match="generation 1 -> 2"):
            _check_unchanged_after_copy(dead, time.monotonic(), daemon, 1, **kw)
        dead.close()
        assert released == [1, 1, 1]
    finally:
        engine.close()
        coordinator.close()
    # The real path end to end: a copy taken now is of generation 2, whole.
    again = attach(ckpt_b, socket_dir=sock_dir, mode="copy", fallback=False)
    assert again.source == "cache" and again.generation == 2
    assert_matches(again.state_dict, reference(ckpt_b))


def test_an_engine_registering_after_a_rank_broke_is_told(daemon, ckpt, ckpt_b, sock_dir):
    """Broken before it registered: it gets the `broken` event at once, like the others
    (broken: an abort after the write with no rollback copy to write back)."""
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    with raw_connect(daemon, 30) as c:
        update = _stage(c, ckpt_b, rollback="off")
        _call(c, "update_pause", update=update, force=True)
        assert _call(c, "update_write", update=update)["ok"]
        assert _call(c, "update_abort", update=update)["phase"] == "broken"
    broken: list[str] = []
    late = follow_updates(res, on_broken=broken.append)
    try:
        assert late.wait_for("broken", timeout=30)
        assert broken and "aborted after the write" in broken[0]
        assert late.broken == broken[0]
    finally:
        late.close()


def test_release_is_refused_while_an_update_writes(daemon, ckpt, ckpt_b, sock_dir):
    res = attach(ckpt, socket_dir=sock_dir, fallback=False)
    part = follow_updates(res)
    try:
        with raw_connect(daemon, 30) as c:
            update = _stage(c, ckpt_b)
            assert _call(c, "update_pause", update=update)["paused"] == 1
            for step in ("paused", "written"):
                reply = query(daemon, "release")
                assert reply["error"] == proto.E_BUSY and step in reply["message"], reply
                if step == "paused":
                    assert _call(c, "update_write", update=update)["ok"]
            assert _call(c, "update_finish", update=update)["generation"] == 2
        assert query(daemon, "release")["ok"]  # once it is over, release works again
    finally:
        part.close()
