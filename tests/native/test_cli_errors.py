"""Every mistake a user can make on the command line gets one line that says what went wrong
and what to do, and a documented exit code (docs/cli.md), never a traceback.

Each case runs the real `weightcache` command in a fresh process, as a user would. This
machine has no CUDA device, so the `--device cuda` cases are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcache.native.daemon import launcher
from weightcache.native.daemon.config import BIND_DELAY_ENV
from weightcache.native.daemon.lifetime import exiting_with_parent, python_module
from weightcache.native.engine.attach_command import build_parser as attach_parser
from weightcache.native.shared.identity import cpu_identity, socket_path
from weightcache.testing.processes import weightcache_cmd

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def run(*args: str, cwd: Path | None = None, env=None) -> tuple[int, str, str]:
    out = subprocess.run([*weightcache_cmd(), *args], capture_output=True, text=True,
                         cwd=cwd, env=env, timeout=120, check=False)
    return out.returncode, out.stdout, out.stderr


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_bare_command_prints_usage_and_exits_2():
    code, out, err = run()
    assert code == 2 and out == ""
    assert err.startswith("usage: weightcache <command>") and "a command is required" in err


@pytest.mark.parametrize("cmd", [["preload", "--model", "/m", "--device", "cuda"],
                                 ["attach", "--model", "/m", "--device", "cuda"],
                                 ["demo", "--device", "cuda"]])
def test_cuda_without_a_gpu(cmd, tmp_path):
    code, out, err = run(*cmd, cwd=tmp_path)
    assert code == 2
    line = one_line(err)
    assert "no CUDA device is visible here" in line and "--device cpu" in line
    if cmd[0] == "attach":  # scripts still get one JSON line on stdout
        assert json.loads(out)["error"] == "bad_input"


def test_pytorch_bin_only_directory_says_convert(tmp_path):
    model = tmp_path / "bin-only"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"not unpickled")
    for cmd in ("preload", "attach"):
        code, _, err = run(cmd, "--model", str(model), cwd=tmp_path)
        assert code == 2, cmd
        line = one_line(err)
        assert "pytorch_model.bin" in line and "convert the weights to safetensors" in line


def test_hub_model_id_says_download_first(tmp_path):
    code, _, err = run("preload", "--model", "meta-llama/Llama-3.1-8B", cwd=tmp_path)
    assert code == 2
    line = one_line(err)
    assert "a local directory is needed" in line and "hf download meta-llama/Llama-3.1-8B" in line


def test_attach_while_the_daemon_loads_says_loading(ckpt, sock_dir, preload):
    p = preload("--model", str(ckpt), "--weight-cache-socket-dir", str(sock_dir),
                env={**os.environ, BIND_DELAY_ENV: "30"})
    lock = Path(f"{socket_path(sock_dir, cpu_identity(0))}.lock")
    deadline = time.monotonic() + 60
    while not lock.exists():
        assert time.monotonic() < deadline and p.proc.poll() is None
        time.sleep(0.05)
    code, out, err = run("attach", "--model", str(ckpt), "--socket-dir", str(sock_dir),
                         "--no-fallback", env={**os.environ, "WEIGHTCACHE_LOADING_WAIT_S": "0"})
    assert code == 1
    assert "a daemon is loading" in one_line(err)
    assert json.loads(out)["error"] == "unavailable"
    p.stop()
    # Once it is gone (lock released and removed), the same attach says there is none.
    code, _, err = run("attach", "--model", str(ckpt), "--socket-dir", str(sock_dir),
                       "--no-fallback")
    assert code == 1 and "loading" not in one_line(err) and "no daemon socket" in err


def test_stale_lock_file_is_not_a_loading_daemon(ckpt, sock_dir):
    from weightcache.native.shared.presence import loading_daemon

    path = socket_path(sock_dir, cpu_identity(0))
    Path(f"{path}.lock").write_text("12345\n")  # left by a daemon killed outright
    assert loading_daemon(path) is None


def test_tp2_with_no_matching_shard_rule_warns_that_everything_is_replicated(
        tmp_path, sock_dir, preload):
    model = tmp_path / "gpt2-style"
    model.mkdir()
    save_file({"wte.weight": torch.ones(16, 8), "h.0.attn.c_attn.weight": torch.ones(8, 24),
               "h.0.mlp.c_fc.weight": torch.ones(8, 32)}, model / "model.safetensors")
    p = preload("--model", str(model), "-tp", "2", "--socket-dir", str(sock_dir))
    p.wait_ready(120)
    p.proc.send_signal(signal.SIGTERM)
    _, err = p.proc.communicate(timeout=60)
    warnings = [ln for ln in err.splitlines() if "WARNING" in ln]
    assert len(warnings) == 1, err
    assert "every tensor is replicated" in warnings[0] and "--shard-rule" in warnings[0]


def test_every_flag_has_help_and_shows_its_default():
    parsers = {"preload": launcher.build_parser(), "attach": attach_parser()}
    for name, parser in parsers.items():
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings} has no help"
        text = parser.format_help()
        assert "(default: 1)" in text and "(default: auto)" in text, name
    assert "-tp" in parsers["attach"].format_help()
    assert "RELEASES the cache" in parsers["attach"].format_help()  # copy mode's effect


def test_flags_are_consistent_across_subcommands(tmp_path):
    a = attach_parser().parse_args(["--model", "m", "-tp", "2", "--socket-dir", "/s"])
    p = launcher.build_parser().parse_args(["--model", "m", "-tp", "2", "--socket-dir", "/s"])
    assert a.tensor_parallel_size == p.tensor_parallel_size == 2
    assert a.socket_dir == p.weight_cache_socket_dir == "/s"


def test_no_shard_rules_daemon_at_tp1_serves_a_default_client(ckpt, sock_dir, preload):
    preload("--model", str(ckpt), "--no-shard-rules", "--socket-dir", str(sock_dir)).wait_ready(120)
    code, out, err = run("attach", "--model", str(ckpt), "--socket-dir", str(sock_dir),
                         "--no-fallback")
    assert code == 0, err
    assert json.loads(out)["source"] == "cache"


def test_children_run_from_the_repository_root():
    """`python -c`/`-m` put the working directory on sys.path and the checkout's `operator/`
    shadows the standard library there; our child interpreters must not see it."""
    bad = subprocess.run([sys.executable, "-S", "-c", "from operator import or_"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "or_" in bad.stderr  # the hazard is real
    argv = exiting_with_parent([*python_module("weightcache.cli"), "preload", "--help"])
    ok = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "--tensor-parallel-size" in ok.stdout
