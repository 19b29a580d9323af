"""The launcher's head start: the checkpoint's first bytes asked of the disk before any rank
reads (torch-free).

With only the model cold (a restart, the rank's libraries in memory) the disk read nothing of
the checkpoint for the first 0.38 s after the launcher was spawned (run88, an H100 VM: the
launcher's interpreter and imports 0.11 s, its checks 0.06 s, the rank's interpreter 0.07 s,
its modules and its import set's census 0.14 s, then the early reads' first call). That is 5%
of the 7.0 s the device took to read the 16 GB checkpoint, so READY could reach 0.95 of the
device read only with the disk at its full rate every other moment. The launcher runs from
0.11 s on. Once it has checked its input, it asks the kernel to read the checkpoint's first
`budget` bytes into the page cache (`POSIX_FADV_WILLNEED`, one readahead window a call:
`importset.ahead`), in whole groups of the early reads' jobs, and tells each rank its budget
(`--head-start-bytes`). The ranks' early reads leave those jobs to the fill (`extents` of
the files and the budget: one function for both sides), and the fill copies them from the
page cache (coldload's per-read choice). So each byte is still read from the disk once, and
no early read races the kernel's readahead for the same range: an early read that found a
range only partly in the page cache would read all of it again.

Measured in turn on H100 VMs (runs 91-92, docs/performance.md): the asks went out 0.12-0.19 s
after the spawn, and the disk read 0.34-0.73 GB of the checkpoint in the first half second
against 0.06-0.43 GB without. READY moved less than the disk's own rate did between READYs (on
the 4-shard layout, four each way: 8.18 s against 8.25 s on average), and no start was
measurably slower (the look at the import set lengthened the launcher's checks by 0-0.03 s; the
spawn never waited for it). So it is on by default.

Only on a restart whose import set is in memory (`judge`, which looks at the set's largest
files beside the launcher's checks: `importset.looks_warm`). Where the ranks' libraries
must come from the disk, each rank reads them first and its early reads wait for them
(importset.py): reads asked in front of them would only slow that. And only where every rank
reads whole files (tensor-parallel size 1): a tensor-parallel rank's early reads take only its
own chunks (tpshare.py).

Correctness does not depend on any of it: the asks only fill the page cache; the fill reads
through it and hashes what it copies, and the files' identities bracket the load.
`WEIGHTCACHE_LOAD_HEAD_START_MIB` sets the budget (loadenv.head_start; 0 turns it off).
`WEIGHTCACHE_LOAD_HEAD_START_COLD=1` asks where the set is cold too (verdict `asked, set
cold`), for the load bench's `dropab` to compare with the default.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from . import loadenv

__all__ = ["HeadStart", "extents"]

JUDGE_WAIT_S = 0.2  # how long the spawn waits for the verdict at most; late means none


def extents(files: list[Path | str], budget: int, chunk: int | None = None) -> dict[Path, int]:
    """Per file, the end of the head start's asks: in name order (the early reads' order),
    each file from its start, in whole groups of `read_jobs()` early jobs, within `budget`
    bytes; it stops at the first group that does not fit. The launcher asks these ranges and
    the rank's early reads leave them to the fill: both call this with the same files, budget
    and knobs. (`extents(files, sum(extents(files, n).values()))` names the same ranges.)"""
    # Here, not at the top: the launcher imports this module before it spawns its ranks, and
    # the early reads' module (with the disk share and the digest) was 27 ms of imports in one
    # `python -X importtime` on the development machine.
    from .earlyread import cover_spans, grid_span, read_jobs, span_of

    span = grid_span(span_of(chunk or loadenv.chunk()))
    group = read_jobs()
    out: dict[Path, int] = {}
    left = budget
    for path in sorted(Path(p) for p in files):
        try:
            size = os.stat(path).st_size
        except OSError:
            break
        spans = cover_spans(size, span)
        end = 0
        for i in range(0, len(spans), group):
            n = spans[min(i + group, len(spans)) - 1][1] - spans[i][0]
            if n > left:
                break
            end, left = spans[min(i + group, len(spans)) - 1][1], left - n
        if end:
            out[path] = end
        if end < size:
            break
    return out


class HeadStart:
    """One launcher's head start: `judge` beside its checks, `begin` once they passed and
    before it spawns its ranks, `stats` for READY. None where the ranks do not read
    `whole_files` (tensor-parallel ones)."""

    def __init__(self, budget: int | None = None, whole_files: bool = True) -> None:
        self.budget = loadenv.head_start() if budget is None else max(0, budget)
        self.whole_files = whole_files
        self.verdict = "off" if self.budget <= 0 else "judging"  # `begin` decides it
        self.asked = 0
        self.files = 0
        self.marks: dict[str, float] = {}
        self._look = "not looked"  # what `_judge` found, once `_judged` is set
        self._judged = threading.Event()

    def judge(self) -> HeadStart:
        """Start looking at the import set, off the caller's thread (where a head start may
        come of it)."""
        if self.budget > 0 and self.whole_files:
            try:
                threading.Thread(target=self._judge, name="weightcache-head-judge",
                                 daemon=True).start()
            except RuntimeError:  # no thread: no head start
                self._look = "failed: no thread"
                self._judged.set()
        return self

    def _judge(self) -> None:
        try:
            from . import importset  # not before the launcher's own checks began

            found, files, _ = importset.chosen()
            if found is None:
                self._look = "no set"
            elif not files:
                self._look = "empty set"
            else:
                self._look = "warm" if importset.looks_warm(files) else "set cold"
        except Exception as exc:  # a head start never fails a start
            self._look = f"failed: {type(exc).__name__}"
        finally:
            self._judged.set()

    def begin(self, files: list[Path | str]) -> int:
        """Ask for the head start's ranges (`extents`) now, in the background, where the
        verdict is warm; the budget they were cut from (the ranks' `--head-start-bytes`), 0
        for none."""
        if self.budget <= 0:
            return 0
        if not self.whole_files:
            self.verdict = "tensor-parallel"
            return 0
        if not self._judged.wait(JUDGE_WAIT_S):
            self.verdict = "late"  # a rank that waits for it would lose what it could save
            return 0
        self.verdict = self._look
        cold = self._look == "set cold" and loadenv.flag(loadenv.HEAD_START_COLD_ENV, False)
        if self._look != "warm" and not cold:
            return 0
        try:
            threading.Thread(target=self._ask, args=(files,), name="weightcache-head-start",
                             daemon=True).start()
        except RuntimeError:
            self.verdict = "failed: no thread"
            return 0
        self.verdict = "asked, set cold" if cold else "asked"
        return self.budget

    def _ask(self, files: list[Path | str]) -> None:
        from .importset import ahead

        try:
            ranges = extents(files, self.budget)
        except Exception as exc:  # the rank cuts the same and leaves them to its fill
            self.verdict = f"failed: {type(exc).__name__}"
            return
        self.asked, self.files = sum(ranges.values()), len(ranges)
        self.marks["head_asking"] = time.monotonic()
        for path, end in ranges.items():
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # the rank's fill reads it, and says why if it cannot
            try:
                ahead(fd, 0, end)
            finally:
                os.close(fd)
        self.marks["head_asked"] = time.monotonic()

    def stats(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "budget_bytes": self.budget,
                "asked_bytes": self.asked, "files": self.files}
