"""Child processes that never outlive their parent (Linux PR_SET_PDEATHSIG).

The agent supervises the daemon launcher and the launcher supervises its ranks; in a pod
the container's end stops them all, but outside one a supervisor killed with SIGKILL would
leave ranks holding the device's sockets and locks. Each child therefore asks the kernel
for SIGTERM when its parent dies.

A child started from a threaded process (the agent runs gRPC threads) must not do this in a
`preexec_fn`: Python code between fork and exec runs the at-fork hooks of every library
(gRPC's among them) in a copy of a process whose other threads vanished, which can deadlock
or crash the child. `exiting_with_parent` instead puts a tiny interpreter in front of the
command that asks for the signal and then execs it; the request survives the exec.
"""

from __future__ import annotations

import os
import sys

from ..shared.libc import PR_SET_PDEATHSIG as _PR_SET_PDEATHSIG
from ..shared.libc import request_parent_death_signal

__all__ = ["exiting_with_parent", "python_module", "request_parent_death_signal"]

# Runs as `python -I -S -c SHIM <parent pid> <command...>`: isolated (no working directory or
# PYTHON* variables on its path: a checkout's `operator/` would shadow the standard library),
# no site import, stdlib only.
SHIM = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    print(f'cannot run {sys.argv[2]}: {exc}', file=sys.stderr)\n"
    "    sys.exit(127)\n"
)


def exiting_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM when this process dies."""
    return [sys.executable, "-I", "-S", "-c", SHIM, str(os.getpid()), *argv]


def python_module(module: str) -> list[str]:
    """`python -P -m module`: run one of our modules in a fresh interpreter from any directory.

    `-m` and `-c` put the working directory first on sys.path, and the repository root has an
    `operator/` folder that shadows the standard library's `operator` (imports then fail with
    "cannot import name 'or_' from 'operator'"). `-P` (Python 3.11+) leaves it off and, unlike
    `-I`, still honours PYTHONPATH, which uninstalled checkouts use.
    """
    return [sys.executable, "-P", "-m", module]
