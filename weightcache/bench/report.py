"""`weightcache bench [--device cpu|cuda] [section ...]`: every benchmark in one report.

Sections are modules found by import path, loaded only when run, so a section whose module is
absent (not installed, not written yet, or needing what this machine lacks) prints
"skipped: not available" instead of failing the rest. A section module exposes
`main(argv: list[str]) -> int`, accepts `--device cpu|cuda` and `--smoke` (its smallest
sizes: CI runs every section that way), and prints its results as ratios
against a baseline it measures in the same run (use `print_ratios` for a uniform table).
The dispatcher prints the machine first, since numbers mean nothing without it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Sequence

SECTIONS: dict[str, str] = {
    "native": "weightcache.bench.native",
    "attach": "weightcache.bench.attach",
    "identity": "weightcache.bench.identity",
    "gpu": "weightcache.bench.gpu",
    "update": "weightcache.bench.update_vs_restart",
    "load": "weightcache.bench.load",
    "restart": "weightcache.bench.restart",
    "operator": "weightcache.bench.operator",
    "admission": "weightcache.bench.admission",
    "alignment": "weightcache.bench.alignment",
}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(device: str) -> dict[str, str]:
    info = {
        "cpu": cpu_model(),
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "kernel": platform.release(),
    }
    if device == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                info["gpu"] = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
                info["cuda"] = str(torch.version.cuda)
            else:
                info["gpu"] = "none visible"
        except ImportError:
            info["gpu"] = "torch not installed"
    return info


def print_ratios(
    title: str,
    baseline: tuple[str, float],
    rows: Sequence[tuple[str, float]],
    *,
    notes: Sequence[str] = (),
) -> None:
    """A table of seconds and speed-up against `baseline` (higher is better)."""
    label_w = max(len(label) for label, _ in [baseline, *rows]) + 2
    print(f"  {title}")
    print(f"    {'':<{label_w}} {'seconds':>10} {'vs baseline':>12}")
    for i, (label, seconds) in enumerate([baseline, *rows]):
        ratio = baseline[1] / seconds if seconds > 0 else float("inf")
        tag = " (baseline)" if i == 0 else ""
        print(f"    {label:<{label_w}} {seconds:>10.4f} {ratio:>11.1f}x{tag}")
    for note in notes:
        print(f"    {note}")
    sys.stdout.flush()


def _module_available(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smoke", action="store_true",
                   help="every section at its smallest size (CI runs this: benchmarks that "
                        "nothing runs rot); figures mean nothing")
    p.add_argument("sections", nargs="*", metavar="section", help=f"{', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; known: {list(SECTIONS)}")
    chosen = args.sections or list(SECTIONS)
    info = machine_info(args.device)
    print("weightcache bench: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    worst = 0
    for name in chosen:
        print(f"\n[{name}]", flush=True)
        path = SECTIONS[name]
        if not _module_available(path):
            print("  skipped: not available", flush=True)
            continue
        module = importlib.import_module(path)
        entry = getattr(module, "main", None)
        if entry is None:
            print("  skipped: not available (no main)", flush=True)
            continue
        t0 = time.perf_counter()
        code = int(entry(["--device", args.device, *(["--smoke"] if args.smoke else [])]) or 0)
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s, exit {code})", flush=True)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def add_smoke_flag(p: argparse.ArgumentParser) -> None:
    """Every section's `--smoke`: its smallest sizes (what CI runs; figures mean nothing)."""
    p.add_argument("--smoke", action="store_true",
                   help="smallest sizes, for CI: runs the code paths; figures mean nothing")
