"""The loopback ports tests hand to the processes they start."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from weightcache.testing import ports


def test_ports_come_from_below_the_range_the_kernel_hands_out_itself():
    low, high = ports.ephemeral_range()
    if not ports.pool(None, (low, high)):
        pytest.skip(f"the ephemeral range starts at {low}: no room below it on this machine")
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= p < low for p in picked), (low, high, picked[:5])
    # A client socket's source port, which took an agent's port before, comes from the range.
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        assert low <= client.getsockname()[1] <= high


def test_a_port_something_listens_on_is_never_handed_out():
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", ports.free_port()))
            s.listen()
            held.append(s)
        bound = {s.getsockname()[1] for s in held}
        assert len(bound) == 50
        assert not bound & {ports.free_port() for _ in range(50)}
    finally:
        for s in held:
            s.close()


def test_xdist_workers_take_disjoint_slices_of_the_pool():
    eph = (32768, 60999)
    slices = [ports.pool(f"gw{i}", eph) for i in range(ports.SLICES)]
    seen: set[int] = set()
    for pool in slices:
        assert len(pool) >= 1000
        assert pool.start >= ports.LOWEST and pool.stop <= eph[0]
        assert not seen & set(pool)
        seen |= set(pool)
    # No xdist: the last slice; a range that leaves no room below it: the kernel's pick.
    assert ports.pool(None, eph) == slices[-1]
    assert ports.pool("gw0", (10500, 60999)) == range(0)


def test_a_process_with_no_room_below_the_range_still_gets_a_free_port(tmp_path):
    probe = ("import socket; from weightcache.testing import ports; "
             "ports.ephemeral_range = lambda: (1024, 65535); p = ports.free_port(); "
             "s = socket.socket(); s.bind(('127.0.0.1', p)); print(p)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    assert 1024 <= int(out.stdout) <= 65535
