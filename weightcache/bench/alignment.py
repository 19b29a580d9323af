"""Alignment section of `weightcache bench`: cache hit rate of TP engines, before and after.

For an 8-GPU node filled with TP2 or TP4 replicas, every engine allocation is scored by the
real decision (`weightcache.contracts.alignment.align`, the code engines run at start-up):
- before: the engine's local rank i runs on the i-th allocated GPU in index order (what vLLM
  does with the container's GPUs when nobody sets CUDA_VISIBLE_DEVICES);
- after: rank i runs on `align(...).order[i]`.
A rank hits when its GPU holds its tp_rank. Allocation sets come from two sources:
- every possible set of k GPUs (each equally likely);
- the NVIDIA device plugin's own choice, replayed here: its `getPreferredAllocation` calls
  go-gpuallocator's best-effort policy (NVIDIA/k8s-device-plugin internal/plugin/server.go
  `alignedAlloc`; NVIDIA/go-gpuallocator gpuallocator/besteffort_policy.go), re-implemented
  below (partition the free GPUs into sets of k maximising the summed pair link scores, then
  take the best set of that partition, first on ties), on two topologies, under a churn of
  TP1/TP2/TP4 engine pods so the free GPUs fragment the way busy nodes do.
The daemon layout is compared too: interleaved (GPU g holds tp_rank g % tp, the planner's) and
blocked (GPU g holds tp_rank g // (8 / tp)).
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from weightcache.bench.report import add_smoke_flag
from weightcache.contracts import alignment as al

GPUS = 8
Layout = Callable[[int, int], int]  # (gpu index, tp) -> tp_rank


def interleaved(g: int, tp: int) -> int:
    return g % tp


def blocked(g: int, tp: int) -> int:
    return g // (GPUS // tp)


LAYOUTS: dict[str, Layout] = {"interleaved (ours)": interleaved, "blocked": blocked}


def uuid(g: int) -> str:
    return f"GPU-0000{g:04x}-0000-0000-0000-000000000000"


def holdings(tp: int, layout: Layout) -> dict[str, al.Holding]:
    out = {}
    for g in range(GPUS):
        rank = layout(g, tp)
        out[uuid(g)] = al.Holding(uuid=uuid(g), tp_rank=rank, tp_size=tp, dp_rank=0,
                                  replica=g // tp, global_rank=g, sockets={})
    return out


# -------------------------------------------------------------------------- device plugin

# Pair scores as go-gpuallocator's calculateGPUPairScore gives them.
NVLINK_PER_LINK = 100
SINGLE_SWITCH, SAME_CPU, CROSS_CPU = 50, 20, 10


def nvswitch_score(a: int, b: int) -> int:
    """HGX H100/H200: every pair joined through NVSwitch by the same 18 links."""
    return 18 * NVLINK_PER_LINK


def pcie_score(a: int, b: int) -> int:
    """A PCIe server: pairs behind one switch, four GPUs per CPU socket."""
    if a // 2 == b // 2:
        return SINGLE_SWITCH
    return SAME_CPU if a // 4 == b // 4 else CROSS_CPU


HOST_BRIDGE = 30
# DGX-1 Volta's hybrid cube mesh, as go-gpuallocator's own tests describe it
# (gpuallocator/common_test.go NewDGX1VoltaNode): NVLinks per pair, PCIe below them.
DGX1_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}


def dgx1_volta_score(a: int, b: int) -> int:
    a, b = min(a, b), max(a, b)
    same_socket, same_switch = a // 4 == b // 4, a // 2 == b // 2
    pcie = (SINGLE_SWITCH if same_switch else HOST_BRIDGE) if same_socket else CROSS_CPU
    return DGX1_NVLINKS.get((a, b), 0) * NVLINK_PER_LINK + pcie


TOPOLOGIES: dict[str, Callable[[int, int], int]] = {
    "HGX NVSwitch": nvswitch_score, "DGX-1 NVLink mesh": dgx1_volta_score,
    "PCIe 2 sockets": pcie_score,
}


def _set_score(gpus: Sequence[int | None], score: Callable[[int, int], int]) -> int:
    return sum(score(a, b) for a, b in itertools.combinations(gpus, 2)
               if a is not None and b is not None)


def _partitions(devices: list[int | None], size: int, padding: int
                ) -> Iterator[list[tuple[int | None, ...]]]:
    if len(devices) == size:
        yield [tuple(devices)]
        return
    first = devices[0]
    for rest in itertools.combinations(devices[1:], size - 1):
        chosen = (first, *rest)
        pads = sum(d is None for d in chosen)
        if pads not in (0, padding):
            continue
        remaining = [d for d in devices if d not in chosen]
        for tail in _partitions(remaining, size, padding):
            yield [chosen, *tail]


def best_effort(available: Sequence[int], size: int, score: Callable[[int, int], int]
                ) -> tuple[int, ...]:
    """go-gpuallocator's best-effort choice of `size` GPUs out of `available` (no required)."""
    if size == 1:
        return (sorted(available)[0],)
    devices: list[int | None] = sorted(available)
    while len(devices) % size:
        devices.append(None)
    padding = sum(d is None for d in devices)
    best, best_score = None, 0
    for partition in _partitions(devices, size, padding):
        total = sum(_set_score(s, score) for s in partition)
        if best is None or total > best_score:
            best, best_score = partition, total
    assert best is not None
    chosen = max(best, key=lambda s: (_set_score(s, score), -best.index(s)))
    return tuple(g for g in chosen if g is not None)


# -------------------------------------------------------------------------- scoring


@dataclass
class Tally:
    ranks: int = 0
    before: int = 0
    after: int = 0
    engines: int = 0
    engines_before: int = 0
    engines_after: int = 0

    def add(self, allocation: Sequence[int], gpus: dict[str, al.Holding], tp: int) -> None:
        visible = [uuid(g) for g in sorted(allocation)]  # the container's index order
        plain = [gpus[u].tp_rank == i for i, u in enumerate(visible)]
        aligned = al.align(visible, gpus, tp)
        self.ranks += tp
        self.before += sum(plain)
        self.after += aligned.hits
        self.engines += 1
        self.engines_before += all(plain)
        self.engines_after += aligned.result == "aligned"

    def row(self) -> tuple[float, float, float, float]:
        return (self.before / self.ranks, self.after / self.ranks,
                self.engines_before / self.engines, self.engines_after / self.engines)


def every_allocation(tp: int, layout: Layout) -> Tally:
    gpus, tally = holdings(tp, layout), Tally()
    for combo in itertools.combinations(range(GPUS), tp):
        tally.add(combo, gpus, tp)
    return tally


def churn(tp: int, layout: Layout, score: Callable[[int, int], int], *, events: int,
          seed: int) -> Tally:
    """Engine pods of TP 1, 2 and 4 arrive and leave; score the TP-`tp` ones of this cache."""
    rng = random.Random(seed)
    gpus, tally = holdings(tp, layout), Tally()
    running: list[tuple[int, ...]] = []
    for _ in range(events):
        if running and (rng.random() < 0.45 or len(running) > 5):
            running.pop(rng.randrange(len(running)))
            continue
        size = rng.choice((1, 2, 4, tp, tp))  # this cache's engines are the common case
        free = sorted(set(range(GPUS)) - {g for r in running for g in r})
        if len(free) < size:
            continue
        allocation = best_effort(free, size, score)
        running.append(allocation)
        if size == tp:
            tally.add(allocation, gpus, tp)
    return tally


def rows(events: int, seed: int) -> list[tuple[str, str, str, int, tuple[float, ...]]]:
    out = []
    for tp in (2, 4):
        for lname, layout in LAYOUTS.items():
            t = every_allocation(tp, layout)
            out.append((f"TP{tp}", "every allocation", lname, t.engines, t.row()))
            for tname, score in TOPOLOGIES.items():
                t = churn(tp, layout, score, events=events, seed=seed)
                out.append((f"TP{tp}", f"device plugin, {tname}", lname, t.engines, t.row()))
    return out


def markdown(table: Sequence[tuple[str, str, str, int, tuple[float, ...]]]) -> str:
    lines = [
        "| engine | allocations | daemon layout | engines | rank hits before | rank hits after "
        "| engines fully cached before | after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp, source, layout, n, (rb, ra, eb, ea) in table:
        lines.append(f"| {tp} | {source} | {layout} | {n} | {rb:.1%} | {ra:.1%} | {eb:.1%} "
                     f"| {ea:.1%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="weightcache bench alignment")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")  # pure computation
    p.add_argument("--events", type=int, default=4000)
    p.add_argument("--seed", type=int, default=16)
    add_smoke_flag(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.events = 200
    print(f"  GPU alignment on an {GPUS}-GPU node (rates; baseline = before, same allocations; "
          f"churn: {args.events} events, seed {args.seed})")
    for line in markdown(rows(args.events, args.seed)).splitlines():
        print(f"    {line}")
    return 0
