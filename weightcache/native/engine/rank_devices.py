"""Which local device a native engine's rank should use to hit the cache.

A native engine picks its own devices (`torch.device("cuda", i)`), so unlike vLLM it needs no
CUDA_VISIBLE_DEVICES trick: it asks `rank_devices(tp_size)` for the device index of each
tp_rank and attaches there. The decision is `weightcache.contracts.alignment.align`, the same
function vLLM engines run at start-up, over this process's visible devices (by UUID, so any
CUDA_VISIBLE_DEVICES remapping is already accounted for).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

from weightcache import constants
from weightcache.contracts import alignment as al

from ..shared.identity import device_identity

log = logging.getLogger("weightcache.native.engine.rank_devices")


def visible_identities(kind: str = "cuda", count: int | None = None) -> list[str]:
    """Identities of this process's devices in index order (torch's view, after remapping)."""
    if kind == "cuda":
        import torch  # cuda only: for cpu the caller gives the count

        count = torch.cuda.device_count() if count is None else count
    elif count is None:
        raise ValueError("count is required for cpu devices")
    return [device_identity(kind, i) for i in range(count)]


def plan(
    tp_size: int, *, socket_dir: str | os.PathLike | None = None,
    visible: Sequence[str] | None = None, kind: str = "cuda", dp_local: int = 1,
) -> al.Alignment:
    """The alignment of this process's devices; raises `al.MapError` without a readable map."""
    directory = str(socket_dir or os.environ.get(constants.ENV_SOCKET_DIR) or "")
    gpu_map = al.read_map(directory)
    if visible is None:
        visible = visible_identities(kind, None if kind == "cuda" else tp_size * dp_local)
    return al.align(list(visible), gpu_map.gpus, tp_size, dp_local=dp_local)


def rank_devices(
    tp_size: int, *, socket_dir: str | os.PathLike | None = None,
    visible: Sequence[str] | None = None, kind: str = "cuda", dp_local: int = 1,
    report: bool = True,
) -> list[int]:
    """Device index for each logical rank (`[tp_rank + group * tp_size]`).

    Without a map (no agent, other cache layout) the answer is the identity order, which is
    what the engine would have done anyway; misses are logged with the GPUs and ranks, and
    (`report`) the first call of a process tree tells the node agent, whose metrics count it.
    Call it once, in the engine's launcher, before starting the rank processes.
    """
    if visible is None:
        visible = visible_identities(kind, None if kind == "cuda" else tp_size * dp_local)
    visible = list(visible)
    try:
        alignment = plan(tp_size, socket_dir=socket_dir, visible=visible, kind=kind,
                         dp_local=dp_local)
    except al.MapError as exc:
        log.warning("weightcache: no GPU alignment (%s); ranks use devices in index order", exc)
        return list(range(min(len(visible), tp_size * dp_local)))
    if alignment.result != "aligned":
        log.warning("weightcache: GPU alignment %s: %s", alignment.result, al.describe(alignment))
    if report and not os.environ.get(al.ENV_ACTIVE):
        # Once per process tree, like the vLLM path: the agent counts engine starts.
        os.environ[al.ENV_ACTIVE] = "1"
        directory = str(socket_dir or os.environ.get(constants.ENV_SOCKET_DIR) or "")
        pod = os.environ.get("POD_NAME") or socket.gethostname()
        al.send_report(directory, al.report(alignment, pod=pod))
    return [al.device_for_rank(alignment, visible, r.local) for r in alignment.ranks]
