"""The content identity of a checkpoint: which bytes, not just which headers.

Why: the fingerprint hashes the safetensors headers only, and a fine-tune (or a checkpoint
rewritten in place by an update) has the very same headers. After an in-place update the
daemon must stop matching engines that ask for the old weights, and must match engines that
ask for the new ones; both sides therefore put `content` into the fingerprint map.

This module is the ONE place that defines it, so that the exact content identity of the other
open issue (a digest computed while loading) can replace it without touching its callers.
Stand-in rule: sha256 over each file's base name, size and mtime in nanoseconds. A copy that
keeps modification times (`cp -p`, `shutil.copytree`) still matches; one that does not misses
the cache and loads from disk, which is the safe direction.
"""

from __future__ import annotations

import hashlib
import os

from .checkpoint import Checkpoint

FIELD = "content"


def file_identities(ckpt: Checkpoint) -> list[list[object]]:
    out: list[list[object]] = []
    for path in sorted(ckpt.files, key=lambda p: p.name):
        st = os.stat(path)
        out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


def content_identity(ckpt: Checkpoint) -> str:
    """`sha256:<hex>` of the checkpoint's file identities (see the module docstring)."""
    h = hashlib.sha256()
    for name, size, mtime in file_identities(ckpt):
        h.update(f"{name}\0{size}\0{mtime}\n".encode())
    return "sha256:" + h.hexdigest()
