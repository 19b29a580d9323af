"""Benchmark section "update": an in-place update against a rolling restart, in one run.

Both move a running cache, with one zero_copy engine (this process) attached, from one
revision of a model to another of the same layout:
- in place: `update_group` (stage into host staging while the engine serves; pause; one copy
  into the existing arena; finish). The engine-visible pause is from the `begin` it receives
  to the `finish` it handles; the total includes staging.
- rolling restart (the baseline): stop the daemon, start `weightcache preload` on the new
  revision, re-attach the engine. The engine keeps its old mapping while the new daemon loads
  (what a zero_copy engine does today), so the device holds both revisions for a while; its
  pause is the re-attach (a real engine restart adds its own start-up on top, ~12 s on the H200).
Peak memory is sampled during each: device memory on CUDA (cudaMemGetInfo, device-wide),
shared memory on CPU (/proc/meminfo Shmem, where memfd arenas live). Nothing is asserted.

    weightcache bench update                                  # CPU, CI-sized checkpoint
    python -m weightcache.bench.update_vs_restart --device cuda --size 8b --workdir /data/wc
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightcache.bench.report import add_smoke_flag

from .report import machine_info, print_ratios

SIZES = ("tiny", "demo", "1b", "8b")


def _shmem_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Highest memory in use (device: total - free; CPU: Shmem) while the block runs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        if self.device == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(0)
            return total - free
        return _shmem_bytes()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.used())
            self._stop.wait(0.002)

    def __enter__(self) -> PeakSampler:
        self.base = self.used()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.used())

    @property
    def peak_extra(self) -> int:
        return max(self.samples, default=self.base) - self.base


def resident_fraction(files: list[Path]) -> float | None:
    """The share of the files' pages the page cache holds (None where it cannot say)."""
    from weightcache.native.shared.residency import resident_pages

    held = total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            found = resident_pages(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if found is None:
            return None
        held, total = held + found[0], total + found[1]
    return round(held / total, 4) if total else None


def write_revisions(size: str, workdir: Path) -> tuple[Path, Path, int]:
    """Two checkpoints with identical headers and different bytes."""
    a, b = workdir / f"{size}-rev1", workdir / f"{size}-rev2"
    if size in ("tiny", "demo"):
        from weightcache.testing.checkpoints import DEMO, TINY, write_llama_checkpoint

        shape = TINY if size == "tiny" else DEMO
        for path, seed in ((a, 0), (b, 1)):
            if not path.exists():
                write_llama_checkpoint(path, shape, files=2, seed=seed)
    else:
        from .gpu import ALIASES, MODELS, write_checkpoint

        spec = MODELS[ALIASES[size]]
        for path, seed in ((a, 0), (b, 1)):
            if not (path / "model.safetensors.index.json").exists():
                write_checkpoint(path, spec, seed=seed)
    nbytes = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    return a, b, nbytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from weightcache.client import attach, follow_updates
    from weightcache.native.coordinator import discover, update_group
    from weightcache.testing.processes import Preload

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="wc-bench-update-"))
    workdir.mkdir(parents=True, exist_ok=True)
    a, b, file_bytes = write_revisions(args.size, workdir)
    sockets = Path(tempfile.mkdtemp(prefix="wcu", dir="/tmp"))
    os.chmod(sockets, 0o700)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    flags = ["--weight-cache-socket-dir", str(sockets), "--device", args.device]
    if args.transport:
        flags += ["--transport", args.transport]
    out: dict[str, Any] = {"section": "update", "size": args.size, "checkpoint_bytes": file_bytes,
                           "machine": machine_info(args.device)}
    daemon = Preload(["--model", str(a), *flags])
    try:
        daemon.wait_ready(1800)
        engine = attach(a, device=device, socket_dir=sockets, mode="zero_copy", fallback=False)
        marks: dict[str, float] = {}
        part = follow_updates(
            engine, on_pause=lambda: marks.setdefault("begin", time.perf_counter()),
            on_resume=lambda g, c: marks.setdefault("finish", time.perf_counter()))
        assert part is not None
        ptrs = [t.data_ptr() for t in engine.state_dict.values()]
        # Staging's reference in the same run: one reader through the page cache (warm).
        from .gpu import _files, _warm

        page_cache_gbps = max(_warm(_files(b)) for _ in range(2))
        # Staging reads the new files' pages where they are and the rollback source is the old
        # files' pages: what the page cache held of each says whether the stage met the disk.
        resident_before = {"new": resident_fraction(_files(b)), "old": resident_fraction(_files(a))}
        with PeakSampler(args.device) as inplace_mem:
            t0 = time.perf_counter()
            result = update_group(discover(sockets), model=str(b), timeout_s=3600)
            inplace_total = time.perf_counter() - t0
        part.wait_for("finish")
        part.close()
        out["in_place"] = {
            **result,
            "engine_pause_s": round(marks["finish"] - marks["begin"], 6),
            "total_s": round(inplace_total, 6),
            "peak_extra_bytes": inplace_mem.peak_extra,
            "addresses_kept": ptrs == [t.data_ptr() for t in engine.state_dict.values()],
            # Read + content digest of the new revision into staging, in one pass.
            "staging_gb_per_s": round(result["bytes"] / result["seconds_staged"] / 1e9, 3)
            if result.get("seconds_staged") else None,
            "page_cache_read_gb_per_s": round(page_cache_gbps, 3),
            "page_cache_resident_before": resident_before,
        }
        # Baseline: a rolling restart to the other revision, the engine re-attaching.
        with PeakSampler(args.device) as restart_mem:
            t0 = time.perf_counter()
            daemon.stop()
            daemon = Preload(["--model", str(a), *flags])
            daemon.wait_ready(1800)
            load_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            fresh = attach(a, device=device, socket_dir=sockets, mode="zero_copy",
                           fallback=False)
            reattach_s = time.perf_counter() - t1
            del engine  # the old mapping goes only now: two revisions were held until here
            restart_total = time.perf_counter() - t0
        out["rolling_restart"] = {
            "daemon_reload_s": round(load_s, 6), "engine_reattach_s": round(reattach_s, 6),
            "total_s": round(restart_total, 6), "peak_extra_bytes": restart_mem.peak_extra,
            "source": fresh.source,
        }
        del fresh
    finally:
        daemon.stop()
        shutil.rmtree(sockets, ignore_errors=True)
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    out["staging_buffer"] = staging_buffer_figures(result["bytes"], device)
    if args.device == "cuda":
        from .gpu import h2d_rate

        out["h2d_pinned"] = h2d_rate(min(4 << 30, max(result["bytes"], 1 << 20)))
    return out


def staging_buffer_figures(nbytes: int, device: Any) -> dict[str, Any]:
    """Seconds to make `nbytes` of host staging ready (pinned on CUDA): the daemon's way
    (staging.host_buffer: populated by several threads, then registered) against an untouched
    allocation registered as it is (the driver populates it on one thread), in the same run."""
    import torch

    from weightcache.native.daemon.staging import host_buffer

    def plain() -> Any:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if device.type == "cuda":
            runtime = torch.cuda.cudart()
            runtime.cudaHostRegister(buf.data_ptr(), nbytes, 0)
            runtime.cudaHostUnregister(buf.data_ptr())
        else:
            buf.fill_(0)  # first touch, as the load's copies would do it
        return buf

    # Alternated, twice each: memory the machine hands out for the first time is slower to
    # touch (a VM backs it then), and that must not fall on one side only.
    times: dict[str, list[float]] = {"plain_s": [], "daemon_s": []}
    for _ in range(2):
        for name, make in (("plain_s", plain), ("daemon_s", lambda: host_buffer(nbytes, device))):
            t0 = time.perf_counter()
            buf = make()
            times[name].append(round(time.perf_counter() - t0, 4))
            del buf
    return {**{k: min(v) for k, v in times.items()}, "runs": times}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache bench update",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--size", choices=SIZES, default=None,
                   help="checkpoint shape: tiny/demo (CPU), 1b, 8b (16 GB); default: demo on "
                        "CPU, 8b on CUDA")
    p.add_argument("--transport", default=None, help="arena transport (default: best)")
    p.add_argument("--workdir", default=None, help="where the two revisions are written")
    p.add_argument("--keep", action="store_true", help="keep generated checkpoints")
    add_smoke_flag(p)
    p.add_argument("--out", default=None, help="also write the JSON result here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.size = args.size or "tiny"
    args.size = args.size or os.environ.get("WEIGHTCACHE_BENCH_UPDATE_SIZE") or (
        "8b" if args.device == "cuda" else "demo")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("  skipped: no CUDA device", flush=True)
            return 0
    report = run(args)
    ip, rr = report["in_place"], report["rolling_restart"]
    print_ratios(
        f"update {args.size} ({report['checkpoint_bytes'] / 1e9:.2f} GB) on {args.device}: "
        "seconds until the engine serves the new revision",
        ("rolling restart (reload + re-attach)", rr["total_s"]),
        [("in-place update (stage + pause)", ip["total_s"])],
        notes=[
            f"engine-visible pause: in place {ip['engine_pause_s']:.4f} s "
            f"(write {ip['seconds_write']:.4f} s), restart re-attach "
            f"{rr['engine_reattach_s']:.4f} s + the engine's own restart",
            f"peak extra memory: in place {ip['peak_extra_bytes'] / 1e6:.1f} MB, "
            f"rolling restart {rr['peak_extra_bytes'] / 1e6:.1f} MB",
            f"addresses kept: {ip['addresses_kept']}",
            f"staging (read + digest, one pass): {ip['staging_gb_per_s']} GB/s against one "
            f"page-cache reader's {ip['page_cache_read_gb_per_s']} GB/s",
            f"staging phases (s): {ip.get('stage_phases')}",
            f"page cache held before the stage: {ip.get('page_cache_resident_before')}",
            f"host staging made ready: {report['staging_buffer']['daemon_s']} s, an untouched"
            f" allocation {'registered' if args.device == 'cuda' else 'touched'} as it is "
            f"{report['staging_buffer']['plain_s']} s",
        ],
    )
    print("  " + json.dumps(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
