"""The steps of a daemon rank's start, each alone and in-process (`daemon/rank.py`,
`daemon/config.py`, `daemon/loading.py`): the same refusals and exit codes the process tests
see from outside, without starting a process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightcache.contracts.vocabulary import EXIT_BAD_INPUT, EXIT_LOCKED, EXIT_SECURITY
from weightcache.native.daemon import rank
from weightcache.native.daemon.config import RankConfig, RankRefused, build_parser
from weightcache.native.daemon.progress import PhaseClock


def config_for(*argv: str) -> RankConfig:
    return RankConfig.from_args(build_parser().parse_args(list(argv)))


def test_flags_become_one_typed_config(ckpt, sock_dir):
    config = config_for("--model", str(ckpt), "-tp", "2", "--rank", "1", "--dp-rank", "3",
                        "--role", "main", "--weight-cache-socket-dir", str(sock_dir),
                        "--weight-cache-allow-uid", "65534", "--no-shard-rules")
    assert (config.tp_size, config.tp_rank, config.device_index, config.global_rank) == (2, 1, 1, 1)
    assert config.role == "target" and config.allowed_uids == (65534,)
    assert config.shard_rules == [] and config.dp_rank == 3


@pytest.mark.parametrize("argv", [["-tp", "2", "--rank", "2"], ["--device-index", "-1"],
                                  ["--dp-rank", "-1"]])
def test_a_rank_that_cannot_exist_is_refused_before_anything(ckpt, argv):
    with pytest.raises(RankRefused) as refused:
        config_for("--model", str(ckpt), *argv)
    assert refused.value.code == EXIT_BAD_INPUT


def test_the_launchers_device_uuid_is_a_gpu_uuid_for_a_cuda_rank(ckpt, sock_dir):
    """`--device-uuid` (the launcher's driver query) names the socket and lock of a CUDA rank
    without a cuInit of its own; anything but a GPU UUID, or on a CPU rank, is refused."""
    raw = "GPU-ABCDEF01-2345-6789-ABCD-EF0123456789"
    canonical = "GPU-abcdef01-2345-6789-abcd-ef0123456789"
    config = config_for("--model", str(ckpt), "--device", "cuda", "--device-uuid", raw)
    assert config.device_uuid == canonical
    assert config_for("--model", str(ckpt), "--device", "cuda").device_uuid is None
    for argv in (["--device", "cuda", "--device-uuid", "cuda:0"],
                 ["--device", "cuda", "--device-uuid", "../GPU-0"],
                 ["--device", "cpu", "--device-uuid", raw]):
        with pytest.raises(RankRefused) as refused:
            config_for("--model", str(ckpt), *argv)
        assert refused.value.code == EXIT_BAD_INPUT
    # The socket takes the given name: no driver is asked (none is here).
    held = rank.claim_socket(config_for("--model", str(ckpt), "--device", "cuda",
                                        "--device-uuid", raw,
                                        "--weight-cache-socket-dir", str(sock_dir)))
    try:
        assert held.path == sock_dir / f"{canonical}.sock"
        assert Path(f"{held.path}.lock").exists()
    finally:
        held.lock.release()


def test_read_input_refuses_a_bad_checkpoint_or_rule(ckpt, tmp_path):
    with pytest.raises(RankRefused) as refused:
        rank.read_input(config_for("--model", str(tmp_path / "missing")))
    assert refused.value.code == EXIT_BAD_INPUT
    with pytest.raises(RankRefused):
        rank.read_input(config_for("--model", str(ckpt), "--shard-rule", "no-dim"))
    ckpt_, rules = rank.read_input(config_for("--model", str(ckpt)))
    assert ckpt_.files and rules


def test_claim_socket_takes_the_lock_once(ckpt, sock_dir):
    config = config_for("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    held = rank.claim_socket(config)
    try:
        assert Path(f"{held.path}.lock").exists() and not held.path.exists()
        with pytest.raises(RankRefused) as refused:
            rank.claim_socket(config)
        assert refused.value.code == EXIT_LOCKED
    finally:
        held.lock.release()


def test_claim_socket_refuses_a_world_writable_directory(ckpt, tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(RankRefused) as refused:
        rank.claim_socket(config_for("--model", str(ckpt), "--weight-cache-socket-dir",
                                     str(open_dir)))
    assert refused.value.code == EXIT_SECURITY


def test_the_phase_clock_times_each_phase_in_order():
    clock = PhaseClock()
    clock.mark("startup_seconds")
    clock.mark("cuda_init_seconds")
    assert list(clock.phases) == ["startup_seconds", "cuda_init_seconds"]
    assert all(v >= 0 for v in clock.phases.values())
    clock.stamp("exec", 12.5)
    clock.stamp("locked")
    assert clock.marks["exec"] == 12.5 and clock.marks["locked"] > 12.5  # time.monotonic()


def test_plan_refuses_rules_that_do_not_divide(ckpt):
    from weightcache.native.daemon import loading  # torch, as in a rank once it holds its lock

    config = config_for("--model", str(ckpt), "-tp", "7", "--rank", "0")
    ckpt_, rules = rank.read_input(config)
    with pytest.raises(RankRefused) as refused:
        loading.plan(config, ckpt_, rules)
    assert refused.value.code == EXIT_BAD_INPUT


def test_a_loaded_shard_is_served_step_by_step_in_process(ckpt, sock_dir):
    import socket
    import threading

    from weightcache.native.daemon import loading, server
    from weightcache.native.shared import protocol

    config = config_for("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    ckpt_, rules = rank.read_input(config)
    held = rank.claim_socket(config)
    shard = None
    try:
        clock = PhaseClock()
        shard = loading.load(config, ckpt_, rules, held.path, clock, None)
        assert {"plan_seconds", "fill_seconds", "export_seconds"} <= set(clock.phases)
        served = server.serve_shard(shard, config, rules)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        peer = (os.getpid(), os.getuid(), os.getgid())
        thread = threading.Thread(target=served.handle, args=(theirs, peer), daemon=True)
        thread.start()
        with ours:
            protocol.send_frame(ours, {"cmd": "hello"})
            hello, _ = protocol.recv_frame(ours)
            assert hello["ok"] and hello["ready"] and hello["update"]["generation"] == 1
            protocol.send_frame(ours, {"cmd": 7})
            assert protocol.recv_frame(ours)[0]["error"] == protocol.E_BAD_REQUEST
            protocol.send_frame(ours, {"cmd": "nope"})
            assert protocol.recv_frame(ours)[0]["error"] == protocol.E_UNKNOWN_COMMAND
        thread.join(5)
        assert not thread.is_alive()
        assert served.stats.snapshot()["requests"]["hello"] == {"ok": 1}
        served.shutdown()
        shard = None  # the server closed the arena
    finally:
        if shard is not None:
            shard.arena.close()
        held.lock.release()


def test_a_stop_signal_while_the_lock_is_taken_waits_until_it_can_be_released(
        ckpt, sock_dir, monkeypatch):
    """A SIGTERM while the rank takes its socket's lock is only noted (a `Stop` raised inside
    `claim_socket` left the lock file behind: the launcher's stop of a starting rank, seen in
    CI); once the lock is held the rank stops, and gives the lock back."""
    import signal

    from weightcache.contracts.vocabulary import EXIT_OK
    from weightcache.native.shared.identity import cpu_identity, socket_path

    monkeypatch.setattr(rank._Serving, "abandon", True)
    monkeypatch.setattr(rank._Serving, "pending", False)
    claim = rank.claim_socket
    seen: list[bool] = []

    def claim_then_signal(config):
        held = claim(config)
        rank._on_signal(signal.SIGTERM, None)  # the handler, as the signal would run it here
        seen.append(Path(f"{held.path}.lock").exists())
        return held

    monkeypatch.setattr(rank, "claim_socket", claim_then_signal)
    config = config_for("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    assert rank.run(config, (None, None)) == EXIT_OK
    lock = Path(f"{socket_path(sock_dir, cpu_identity(0))}.lock")
    assert seen == [True] and not lock.exists()
    assert not socket_path(sock_dir, cpu_identity(0)).exists()


def test_a_stop_swallowed_on_the_way_still_stops_the_rank_at_its_next_step(
        ckpt, sock_dir, monkeypatch):
    """A SIGTERM whose `Stop` some code swallows (a bare `except:` in a library the rank
    imports, a `__del__` the garbage collector ran just then) still stops the rank at its next
    step, and the lock goes back: the handler clears `abandon` before it raises, so the
    launcher's later signals were only noted, and a clean clone's rank loaded on until it was
    killed 15 s later with its lock file left behind."""
    import signal

    from weightcache.contracts.vocabulary import EXIT_OK
    from weightcache.native.shared.identity import cpu_identity, socket_path

    monkeypatch.setattr(rank._Serving, "abandon", True)
    monkeypatch.setattr(rank._Serving, "pending", False)
    start = rank.start_early_reads
    seen: list[str] = []

    def start_then_swallow(*args, **kwargs):
        try:
            rank._on_signal(signal.SIGTERM, None)  # the signal, where a library catches all
        except BaseException as exc:  # what such a library does
            seen.append(type(exc).__name__)
        rank._on_signal(signal.SIGTERM, None)  # the launcher's next one: only noted
        return start(*args, **kwargs)

    def announced(*args, **kwargs):  # the rank loaded and bound: it would serve from here
        seen.append("announced")
        raise rank.Stop()

    monkeypatch.setattr(rank, "start_early_reads", start_then_swallow)
    monkeypatch.setattr(rank, "announce", announced)
    config = config_for("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir))
    assert rank.run(config, (None, None)) == EXIT_OK
    assert seen == ["Stop"], "a swallowed Stop left the rank loading on"
    path = socket_path(sock_dir, cpu_identity(0))
    assert not Path(f"{path}.lock").exists() and not path.exists()
