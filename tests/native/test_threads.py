"""A signal during a pool's start or wait leaves no work running behind its caller
(`weightcache.native.shared.threads`): after `close()`, every thread that began its work has
ended it and no other begins, which `Thread.join` after a signal cannot promise."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from weightcache.native.shared.threads import Pool


class Stop(BaseException):
    pass


def _raise(signum, frame):
    raise Stop()


@pytest.fixture
def alarm():
    old = signal.signal(signal.SIGALRM, _raise)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _worker(began: list[int], ended: list[int], stop: threading.Event, signal_first: bool):
    def target(i: int) -> None:
        began.append(i)
        if i == 0 and signal_first:
            os.kill(os.getpid(), signal.SIGALRM)  # while the rest of the pool starts
        stop.wait(0.3)
        ended.append(i)
    return target


@pytest.mark.parametrize("background", [False, True])
def test_a_signal_while_the_pool_starts_leaves_no_work_running_after_close(alarm, background):
    """In the caller's start, or while a background helper still starts the rest (the
    signal then lands in the caller's wait): after close(), nothing works or begins."""
    began: list[int] = []
    ended: list[int] = []
    stop = threading.Event()
    pool = Pool(_worker(began, ended, stop, True), 48, "pool")
    with pytest.raises(Stop):
        pool.start(background=background)
        pool.wait()
    stop.set()
    pool.close()
    assert pool.working == 0
    seen = sorted(began)
    assert sorted(ended) == seen  # every thread that began its work ended it
    time.sleep(0.3)
    assert sorted(began) == seen  # and none began after close()


def test_a_signal_during_the_wait_leaves_no_work_running_after_close(alarm):
    """`Thread.join` interrupted by a signal marks a running thread stopped on CPython 3.11 and
    3.12 (bpo-45274's except clause); the pool's own count does not."""
    began: list[int] = []
    ended: list[int] = []
    never = threading.Event()
    pool = Pool(_worker(began, ended, never, False), 4, "pool").start()
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    with pytest.raises(Stop):
        pool.wait()
    assert pool.working > 0  # the signal came while they worked
    pool.close()
    assert sorted(ended) == sorted(began) == [0, 1, 2, 3] and pool.working == 0
    assert not any(t.name.startswith("pool-") for t in threading.enumerate())


def test_a_closed_pool_starts_no_work():
    began: list[int] = []
    pool = Pool(began.append, 3, "pool")
    pool.close()
    pool.start().wait()
    assert began == [] and pool.working == 0


@pytest.mark.parametrize("background", [False, True])
def test_a_thread_that_cannot_start_leaves_the_others_waited_for(background):
    """In the caller, its start raises; on the background helper, `start_error` says so."""
    began: list[int] = []
    pool = Pool(lambda i: (time.sleep(0.1), began.append(i)), 2, "pool")
    used = threading.Thread(target=lambda: None)
    used.start()
    used.join()
    pool.threads[1] = used  # a thread starts once: Pool.start's second start() raises
    if background:
        pool.start(background=True)
    else:
        with pytest.raises(RuntimeError):
            pool.start()
    pool.wait()  # the one that started
    assert began == [0]
    assert isinstance(pool.start_error, RuntimeError) if background else pool.start_error is None


@pytest.mark.parametrize("close_early", [False, True])
def test_on_last_runs_once_after_every_thread_even_those_closed_out(close_early):
    """`on_last` runs exactly once, on the thread that ends last, after all the work (the
    import set's prefetch sets its `done` there): also when `close()` kept threads out."""
    ended: list[int] = []
    calls: list[int] = []
    gate = threading.Event()

    def target(i: int) -> None:
        gate.wait(5)
        ended.append(i)

    pool = Pool(target, 4, "last", on_last=lambda: calls.append(len(ended)))
    if close_early:
        pool.close()  # the threads started after it do nothing
    pool.start()
    gate.set()
    pool.wait()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a second call would have come by now
    assert calls == [0 if close_early else 4]


def test_a_background_start_returns_at_once_and_its_wait_waits_for_every_thread():
    """`start(background=True)` hands the starts to a helper (the rank's main thread goes on to
    its import): it returns while a start is still held up, and `wait()` waits for the helper
    to have started every thread and for their work, not only for those started so far."""
    began: list[int] = []
    ended: list[int] = []
    release = threading.Event()

    def target(i: int) -> None:
        began.append(i)
        time.sleep(0.02)
        ended.append(i)

    pool = Pool(target, 3, "bg", daemon=True)

    class SlowStart(threading.Thread):
        def start(self) -> None:
            release.wait(5)  # a start held up (a loaded machine), the others behind it
            super().start()

    pool.threads[0] = SlowStart(target=pool._run, args=(0,), name="bg-0", daemon=True)
    pool.start(background=True)
    assert began == []  # returned while the first start was held
    waiter = threading.Thread(target=pool.wait)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "wait() returned before the pool's threads were started"
    release.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert sorted(ended) == [0, 1, 2] and pool.start_error is None
