"""Where an update's bytes wait for the paused copy: the checkpoint's own pages, or a host buffer.

Staging must hold the arena's size of new bytes, verified, while engines keep serving, so
that the pause is only the copy into the arena. A host buffer costs that size in memory that
must be allocated, populated and pinned before the first byte is read, and every byte is then
copied into it once more. On the H200 VM memory touched for the first time fills at about
4 GB/s (tests/gpu/probe_staging.py: 8 GiB fresh 2.16 s, the same again once freed 0.87 s), so
16 GB of staging cost 5.9 s before the read began and the stage ran at 1.4 GB/s.

A `FileImage` needs neither. The checkpoint's files are already in the page cache (the new
revision was just written or downloaded), and the paused copy reads them where they are:

- CUDA: each file is mapped read-only and shared, and the mapping is registered with the
  driver (`cuMemHostRegister` with `CU_MEMHOSTREGISTER_READ_ONLY`: the driver pins the page
  cache pages themselves; without the flag it asks to write them, which the kernel refuses for
  a shared file mapping). The paused copy is then one host-to-device copy per tensor at the
  link's speed (53.8 GB/s from such a mapping on the H200 against 6.8 GB/s unregistered), and
  registering 8 GiB took 0.23 s. Pinned pages cannot be evicted or migrated, so the pages the
  device copies are the pages the digest read.
- CPU (memfd arenas): the write reads the files into the arena with pread, in parallel.

What keeps the bytes exact:
- the digest reads the files with pread (`content.digest_into`), never through the mapping: no
  thread of ours touches a mapped page, so a file truncated under it is a short read or an
  error from the driver, never a SIGBUS in the daemon;
- every file's full stat (device, inode, size, mtime, ctime; a user cannot set ctime) is taken
  at open and checked after the digest, before the write and after it. A change before the
  write refuses the write (nothing was touched), after it the update rolls back;
- only where every tensor of the arena keeps its stored dtype (whole, or split by rows: one
  range of the file; split by columns: rows of one, a 2-D copy). A `--dtype` conversion stages
  on the host.

The same image serves a rollback: the generation served now came from files too, and where
they are still in the page cache and are the very files its record names, unchanged (same
path, device, inode, size, mtime and ctime), writing them back restores it exactly, without a
device-to-host copy into fresh host memory and without hashing them again. Its files are
mapped at the stage but registered only if a rollback writes them (about 0.23 s per 8 GiB, then
in the pause): pinning them at every stage, beside the new files, cost the stage as much as
the digest, for a copy that is seldom made.
`WEIGHTCACHE_UPDATE_STAGING=host` turns images off (every update stages on the host).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from ..shared import cgroups, hostmem, libc
from ..shared import content as content_mod
from ..shared.coldload import share_chunks
from ..shared.residency import resident
from ..shared.threads import Pool

log = logging.getLogger("weightcache.update")

STAGING_ENV = "WEIGHTCACHE_UPDATE_STAGING"
STAGING_MODES = ("auto", "host")
POPULATE_MIN_BYTES = 64 << 20  # below this, torch's allocator (and first touch) is quick
PAGE = os.sysconf("SC_PAGE_SIZE")
PIECE_BYTES = 64 << 20  # one pread of a CPU write
PROT_READ, MAP_SHARED = 0x1, 0x01
MAP_FAILED = ctypes.c_void_p(-1).value
CU_MEMHOSTREGISTER_READ_ONLY = 0x08

_mmap = libc.function("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long], ctypes.c_void_p)
_munmap = libc.function("munmap", [ctypes.c_void_p, ctypes.c_size_t])


class ImageRefused(Exception):
    """This checkpoint cannot be staged from its files here (the caller stages on the host)."""


def staging_mode() -> str:
    """`WEIGHTCACHE_UPDATE_STAGING`: auto (files where possible, default) or host; a bad
    value is the default (a knob that only tunes speed never fails an update)."""
    text = os.environ.get(STAGING_ENV, "").strip().lower() or "auto"
    return text if text in STAGING_MODES else "auto"


class Image(Protocol):
    """Bytes ready to be written into an arena (`nbytes` of it, from offset 0)."""

    nbytes: int
    kind: str  # "host" or "files": reported in the stage's phases

    def verify(self) -> None:
        """Raise ContentError if the bytes could have changed since they were verified."""

    def write_into(self, dst: torch.Tensor) -> None:
        """Copy into `dst` (the arena, flat uint8) and wait for it; ContentError if the
        source changed meanwhile (then `dst` may hold anything)."""


class HostBuffer:
    """Staging in host memory of our own (pinned on CUDA): immune to anything done to the
    files once it is filled, at the price of the arena's size in memory."""

    kind = "host"

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()

    def verify(self) -> None:
        return None

    def write_into(self, dst: torch.Tensor) -> None:
        target = dst[: self.nbytes]
        target.copy_(self.tensor, non_blocking=True)
        if target.is_cuda:
            torch.cuda.synchronize(target.device)
        del target


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host staging; page-locked for a CUDA arena, so the paused copy runs at the link's speed.

    Pinned by cudaHostRegister over an exact-size allocation rather than `pin_memory=True`:
    torch's pinned allocator rounds up to a power of two (16 GB would pin 32 GB). A large one
    is a mapping populated by several threads first (hostmem.py): registering untouched
    memory faults it in on one thread inside the driver."""
    if nbytes >= POPULATE_MIN_BYTES:
        buf = torch.frombuffer(hostmem.populated(nbytes), dtype=torch.uint8)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    if device.type != "cuda" or nbytes == 0:
        return buf
    runtime = torch.cuda.cudart()
    ptr = buf.data_ptr()
    err = runtime.cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        log.warning("cudaHostRegister of %d bytes failed (%s): torch's pinned allocator", nbytes,
                    err)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    weakref.finalize(buf, runtime.cudaHostUnregister, ptr)  # before the memory is freed
    return buf


@dataclass
class _File:
    path: Path
    fd: int
    ident: content_mod.FileIdentity  # device, inode, size, mtime, ctime at open
    size: int
    addr: int = 0  # the read-only mapping (CUDA), 0 if none
    length: int = 0
    registered: bool = False


def _release(files: list[_File], ordinal: int | None) -> None:
    """Unregister, unmap and close (the image's finalizer: runs once, on any thread)."""
    for f in files:
        if f.registered and ordinal is not None:
            with contextlib.suppress(Exception):
                from ..shared.transport import _cuda

                _cuda.make_current(ordinal)
                _cuda.bindings().cuMemHostUnregister(f.addr)
            f.registered = False
        if f.addr and _munmap is not None:
            _munmap(f.addr, f.length)
            f.addr = 0
        with contextlib.suppress(OSError):
            os.close(f.fd)


class Run(NamedTuple):
    """One tensor's bytes: `height` rows of `width` bytes, `pitch` apart in the file (a
    column split), packed at `arena_at`; one row for a whole tensor or a row split."""

    path: Path
    file_at: int
    arena_at: int
    width: int
    height: int = 1
    pitch: int = 0


class FileImage:
    """A checkpoint's pages as staging (module docstring); build with `file_image`."""

    kind = "files"

    def __init__(self, files: dict[Path, _File], runs: list[Run], nbytes: int,
                 record: dict[str, content_mod.FileDigest], ordinal: int | None,
                 unpinned: Iterable[_File] = ()) -> None:
        self.files, self.runs, self.nbytes, self.record = files, runs, nbytes, record
        self._ordinal = ordinal
        self._unpinned = list(unpinned)  # mapped, registered at the first write (`pin_later`)
        self.pin_seconds = 0.0  # of that late registration
        self._sources: dict[Path, torch.Tensor] = {}
        self._add_sources()
        self._finalizer = weakref.finalize(self, _release, list(files.values()), ordinal)

    def _add_sources(self) -> None:
        for f in self.files.values():
            if f.registered and f.path not in self._sources:  # over the pinned pages (read-only)
                array = (ctypes.c_uint8 * f.size).from_address(f.addr)
                self._sources[f.path] = torch.frombuffer(array, dtype=torch.uint8)

    def _pin(self) -> bool:
        """Register the files left for the write, one thread each: False if the driver
        refused one (the write then goes through host memory)."""
        if not self._unpinned:
            return True
        t0 = time.monotonic()
        ordinal = self._ordinal
        assert ordinal is not None
        try:
            _register_all(self._unpinned, ordinal)
        except ImageRefused as exc:
            log.warning("%s: writing through host memory", exc)
            return False
        finally:
            self.pin_seconds = time.monotonic() - t0
        self._unpinned = []
        self._add_sources()
        return True

    def close(self) -> None:
        self._sources.clear()
        self._finalizer()

    def verify(self) -> None:
        for f in self.files.values():
            try:
                now = content_mod.FileIdentity.of(os.fstat(f.fd))
                named = content_mod.FileIdentity.of(os.stat(f.path))
            except FileNotFoundError:
                raise content_mod.ContentError(f"{f.path} was removed since it was staged") \
                    from None
            if (named.dev, named.ino) != (f.ident.dev, f.ident.ino):  # replacing moves ctime
                raise content_mod.ContentError(f"{f.path} was replaced since it was staged")
            if now != f.ident or named != f.ident:
                raise content_mod.ContentError(f"{f.path} was written since it was staged")

    def write_into(self, dst: torch.Tensor) -> None:
        self.verify()
        if not dst.is_cuda:
            self._pread_into(dst)
        elif self._pin():
            self._copy_to_device(dst)
        else:
            self._through_host(dst)
        self.verify()  # a writer during the copy: the caller rolls back

    def _through_host(self, dst: torch.Tensor) -> None:
        """The files read into a host buffer of ours, then copied: for a late registration
        the driver refused. No host thread touches a mapped page (as a pageable copy from the
        mapping would: a SIGBUS if the file were truncated under it)."""
        avail = cgroups.available_memory()
        if avail is not None and avail < self.nbytes + hostmem.RESERVE_BYTES:
            raise ImageRefused(f"the driver would not pin the files and host memory holds no "
                               f"copy of {self.nbytes} bytes ({avail} available)")
        host = host_buffer(self.nbytes, dst.device)
        self._pread_into(host)
        HostBuffer(host).write_into(dst)

    def _copy_to_device(self, dst: torch.Tensor) -> None:
        """One copy per tensor from the pinned pages, on the device's current stream: a
        column split is one 2-D copy (the driver walks the rows; no host thread touches the
        pages, as a strided torch copy would to make its source contiguous first)."""
        base = dst.data_ptr()
        with torch.cuda.device(dst.device):
            stream = torch.cuda.current_stream()
            for run in self.runs:
                if run.height == 1:
                    source = self._sources[run.path][run.file_at: run.file_at + run.width]
                    dst[run.arena_at: run.arena_at + run.width].copy_(source, non_blocking=True)
                else:
                    _copy_2d(self.files[run.path].addr + run.file_at, run.pitch,
                             base + run.arena_at, run.width, run.height, stream.cuda_stream)
            stream.synchronize()

    def _pread_into(self, dst: torch.Tensor) -> None:
        flat = dst.numpy()
        pieces = [(run.path, run.file_at + r * run.pitch + k, run.arena_at + r * run.width + k,
                   min(PIECE_BYTES, run.width - k))
                  for run in self.runs for r in range(run.height)
                  for k in range(0, run.width, PIECE_BYTES)]

        def read(piece: tuple[Path, int, int, int]) -> None:
            path, file_at, arena_at, n = piece
            got = os.preadv(self.files[path].fd, [memoryview(flat[arena_at: arena_at + n])],
                            file_at)
            if got != n:
                raise content_mod.ContentError(f"{path}: short read ({got} of {n} bytes)")

        _parallel(read, pieces)


def _copy_2d(src: int, pitch: int, dst: int, width: int, height: int, stream: int) -> None:
    from ..shared.transport import _cuda

    cu = _cuda.bindings()
    copy = cu.CUDA_MEMCPY2D()
    copy.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
    copy.srcHost = src
    copy.srcPitch = pitch
    copy.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    copy.dstDevice = dst
    copy.dstPitch = width
    copy.WidthInBytes = width
    copy.Height = height
    _cuda.check(cu.cuMemcpy2DAsync(copy, stream), "cuMemcpy2DAsync")


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any], threads: int | None = None) -> list:
    items = list(items)
    if not items:
        return []
    count = max(1, min(threads or cgroups.usable_cpus(), len(items)))
    with ThreadPoolExecutor(count, thread_name_prefix="weightcache-stage") as pool:
        return list(pool.map(fn, items))


def _run(entry: Any) -> Run:
    """Where a loader `Entry`'s arena bytes are in its file (`coldload.copy_entry`'s bytes)."""
    src, spec = entry.source, entry.spec
    if entry.dtype != src.dtype:
        raise ImageRefused(f"tensor {entry.name!r} is converted to {entry.dtype}")
    path = Path(src.file)
    if spec.dim is None:
        return Run(path, src.offset, entry.offset, src.nbytes)
    outer, inner = 1, src.dtype.itemsize
    for d in src.shape[: spec.dim]:
        outer *= d
    for d in src.shape[spec.dim + 1:]:
        inner *= d
    width = spec.length * inner
    if width * outer != entry.nbytes:
        raise ImageRefused(f"tensor {entry.name!r}: a split this image cannot copy")
    if outer == 1:
        return Run(path, src.offset + spec.start * inner, entry.offset, width)
    return Run(path, src.offset + spec.start * inner, entry.offset, width, outer,
               src.shape[spec.dim] * inner)


def _runs(layout: Any) -> list[Run]:
    return [_run(entry) for entry in layout.entries if entry.nbytes]


def _map(f: _File) -> None:
    """Map `f` read-only, shared, and fault its pages in (from the page cache, or the disk)."""
    if _mmap is None:
        raise ImageRefused("the C library has no mmap")
    f.length = -(-f.size // PAGE) * PAGE
    addr = _mmap(None, f.length, PROT_READ, MAP_SHARED, f.fd, 0)
    if addr is None or addr == MAP_FAILED:
        raise ImageRefused(f"cannot map {f.path}: {os.strerror(ctypes.get_errno())}")
    f.addr = addr
    err = hostmem.populate(f.addr, f.length, hostmem.MADV_POPULATE_READ, threads=8)
    if err == errno.EFAULT:
        raise content_mod.ContentError(f"{f.path} is shorter than when it was opened")
    if err:  # EINVAL before Linux 5.14: the driver's pin faults the pages in itself
        log.debug("MADV_POPULATE_READ of %s: %s", f.path, os.strerror(err))


def _register_all(files: list[Any], ordinal: int) -> None:
    """Pin every file's mapping for the device, one thread per file (ImageRefused if the
    driver refuses one)."""
    _parallel(lambda f: _register(f, ordinal), files, len(files))


def _register(f: _File, ordinal: int) -> None:
    from ..shared.transport import _cuda

    cu = _cuda.bindings()
    _cuda.make_current(ordinal)
    result = cu.cuMemHostRegister(f.addr, f.length, CU_MEMHOSTREGISTER_READ_ONLY)
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ImageRefused(f"the driver would not pin {f.path} ({_cuda.error_name(err)})")
    f.registered = True


def file_image(layout: Any, digest: list[Path], device: torch.device, *, share: bool = False,
               known: dict[str, content_mod.FileDigest] | None = None,
               resident_only: bool = False, pin_later: bool = False,
               threads: int | None = None) -> tuple[FileImage, dict[str, float]]:
    """The files of `layout` as staging, their content record taken by one read of each
    wanted chunk: (image, seconds per step).

    `digest` are the checkpoint's files (all are hashed: the content root names them all; with
    `share`, only the chunks this layout reads, as the loader's record). `known`: the record
    taken when these files were read before (a rollback source: the generation served); then
    nothing is hashed, and every file must be the very file it names, unchanged: the same real
    path and the same identity (device, inode, size, mtime, ctime: any write moves ctime,
    which no user can set back), else ImageRefused. `resident_only`: refuse unless the page
    cache holds every file whole. `pin_later` (a rollback source, seldom written): the files are
    mapped and their pages faulted in now (milliseconds: nothing is copied), registered with the
    driver only if the image is written (FileImage._pin), so that the stage does not pin a
    second arena's size beside the one it writes. Raises ImageRefused where this path does not
    apply, ContentError where a file is unreadable or changed."""
    if staging_mode() == "host":
        raise ImageRefused(f"{STAGING_ENV}=host")
    runs = _runs(layout)
    ordinal: int | None = None
    if device.type == "cuda":
        from ..shared.transport import _cuda

        if not _cuda.full_bindings_importable():
            raise ImageRefused("no CUDA driver bindings")
        ordinal = _cuda.device_ordinal(device)
    t0 = time.monotonic()
    files: dict[Path, _File] = {}
    image: FileImage | None = None
    try:
        for path in sorted({r.path for r in runs} | {Path(p) for p in digest}):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise content_mod.ContentError(f"{path} disappeared before it was staged") \
                    from None
            st = os.fstat(fd)
            files[path] = _File(path, fd, content_mod.FileIdentity.of(st), st.st_size)
        for run in runs:
            end = run.file_at + (run.height - 1) * run.pitch + run.width
            if end > files[run.path].size:
                raise content_mod.ContentError(
                    f"{run.path} holds {files[run.path].size} bytes but its header places a "
                    f"tensor up to byte {end}: truncated or replaced since it was opened")
        if resident_only and not all(resident(f.fd, 0, f.size) for f in files.values()):
            raise ImageRefused("the page cache does not hold every file")
        needed = {r.path for r in runs}
        pin = [files[p] for p in sorted(needed) if files[p].size] if ordinal is not None else []
        idents = {Path(p): files[Path(p)].ident for p in digest}
        if known is not None:
            _check_known(known, idents)
        sink = content_mod.ChunkSink(idents,
                                     coverage=share_chunks(layout.entries) if share else None)
        steps: dict[str, float] = {}
        errors: list[BaseException] = []

        def pin_all() -> None:
            t = time.monotonic()
            for f in pin:
                _map(f)
            if pin and not pin_later:
                assert ordinal is not None
                _register_all(pin, ordinal)
            steps["pin_seconds"] = time.monotonic() - t

        # Pinning and the digest run side by side: both read the same page-cache pages.
        pin_run = _capture(pin_all, errors)
        pinning = Pool(lambda _: pin_run(), 1, "weightcache-pin").start()
        t_digest = time.monotonic()
        try:
            if known is None:
                content_mod.digest_into(sink, {p: f.fd for p, f in files.items()},
                                        workers=threads)
            steps["digest_seconds"] = time.monotonic() - t_digest  # its own time, not the pin's
            pinning.wait()
        except BaseException:
            pinning.close()  # a signal's exception too waits for the pins (threads.py)
            raise
        if errors:
            raise errors[0]
        record = sink.record() if known is None else dict(known)
        image = FileImage(files, runs, layout.nbytes, record, ordinal,
                          pin if pin_later else ())
        image.verify()
        steps["seconds"] = time.monotonic() - t0
        return image, steps
    except BaseException:
        if image is not None:
            image.close()
        else:
            _release(list(files.values()), ordinal)
        raise


def _check_known(known: dict[str, content_mod.FileDigest],
                 idents: dict[Path, content_mod.FileIdentity]) -> None:
    if set(known) != {p.name for p in idents}:
        raise ImageRefused("the checkpoint's files are not the ones served")
    for path, ident in idents.items():
        was = known[path.name]
        if os.path.realpath(path) != was.path or ident != was.identity:
            raise ImageRefused(f"{path} is not the file served (written or replaced since)")


def _capture(fn: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """Run `fn`, keeping its exception in `errors` for the caller's thread to raise."""
    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
    return run


def refusal(layout: Any, device: torch.device) -> str | None:
    """Why `file_image` cannot stage this layout at all, or None (it may still be refused
    later: a driver that will not pin, a file that changed)."""
    if staging_mode() == "host":
        return f"{STAGING_ENV}=host"
    try:
        _runs(layout)
    except ImageRefused as exc:
        return str(exc)
    if device.type != "cuda":
        return None
    from ..shared.transport import _cuda

    return None if _cuda.full_bindings_importable() else "no CUDA driver bindings"
