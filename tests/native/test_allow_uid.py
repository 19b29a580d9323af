"""`--weight-cache-allow-uid` with the shipped client: an engine of another uid attaches.

Needs root (to run the engine as another uid); skipped otherwise. The daemon runs as root
with a socket directory the engine's uid can search (0711); the engine names the daemon's
uid in WEIGHTCACHE_DAEMON_UID so its own directory, socket and peer checks trust it. The
engine imports the client as root (the interpreter and venv may live where another uid
cannot read), then drops to uid 65534 for good before it attaches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from weightcache.testing.processes import Preload

NOBODY = 65534
ENGINE = f"""
import json, os, sys
from weightcache.native.engine.attach import attach
os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
res = attach(sys.argv[1], socket_dir=sys.argv[2], fallback=True)
print(json.dumps({{"uid": os.getuid(), "source": res.source, "reason": res.reason}}))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run an engine as another uid")
def test_an_allowed_uid_attaches_with_the_shipped_client(ckpt):
    base = Path(tempfile.mkdtemp(prefix="weightcache-allow-"))
    try:
        os.chmod(base, 0o755)
        model = Path(shutil.copytree(ckpt, base / "model"))
        for p in [model, *model.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        sockets = base / "sockets"
        sockets.mkdir()
        os.chmod(sockets, 0o711)
        daemon = Preload(["--model", str(model), "--weight-cache-socket-dir", str(sockets),
                          "--weight-cache-allow-uid", str(NOBODY)])
        try:
            daemon.wait_ready(120)
            cmd = [sys.executable, "-c", ENGINE, str(model), str(sockets)]
            env = {**os.environ, "HOME": "/tmp"}
            refused = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/",
                                     timeout=120)
            # Without naming the daemon's uid the engine refuses it (and loads from disk).
            assert refused.returncode == 0, refused.stderr
            got = json.loads(refused.stdout.splitlines()[-1])
            assert (got["uid"], got["source"]) == (NOBODY, "disk")
            assert "security" in got["reason"]
            env["WEIGHTCACHE_DAEMON_UID"] = "0"
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/",
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            got = json.loads(out.stdout.splitlines()[-1])
            assert (got["uid"], got["source"]) == (NOBODY, "cache"), got
        finally:
            daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
