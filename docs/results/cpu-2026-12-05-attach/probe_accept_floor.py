"""What a new connection's first reply costs in a bare Python Unix-socket server, by how the
server gets the connection to a thread (nothing of weightcache: the floor under the daemon).

    for m in thread queue acceptors ordered; do python probe_accept_floor.py $m; done

- thread: one accept loop (with a timeout, as the daemon's was), a thread started per
  connection;
- queue: the same accept loop hands each connection to 4 idle threads through a queue;
- acceptors: 4 idle threads each blocked in accept(), serving what they accept;
- ordered: the same, one at a time in accept() (a lock around it, as the daemon admits
  connections in the order they came).

A client process makes 400 connections, each sending one message and reading the reply twice:
the median of the first reply (connect included) and of the second.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import sys
import tempfile
import threading
import time

PATH = os.path.join(tempfile.gettempdir(), "wc-probe-accept-floor.sock")


def handle(conn: socket.socket) -> None:
    with conn:
        while conn.recv(100):
            conn.sendall(b"x" * 50)


def accept_loop(listener: socket.socket, dispatch) -> None:
    """One thread accepting with a timeout (as the daemon's loop did), `dispatch(conn)` each."""
    listener.settimeout(0.25)

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            dispatch(conn)
    threading.Thread(target=loop, daemon=True).start()


def serve(mode: str, listener: socket.socket) -> None:
    if mode == "thread":
        accept_loop(listener, lambda conn: threading.Thread(
            target=handle, args=(conn,), daemon=True).start())
    elif mode == "queue":
        conns: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()

        def work() -> None:
            while True:
                handle(conns.get())

        for _ in range(4):
            threading.Thread(target=work, daemon=True).start()
        accept_loop(listener, conns.put)
    else:
        order = threading.Lock() if mode == "ordered" else contextlib.nullcontext()

        def accept() -> None:
            while True:
                with order:
                    conn, _ = listener.accept()
                handle(conn)

        for _ in range(4):
            threading.Thread(target=accept, daemon=True).start()


def client(mode: str) -> None:
    first, second = [], []
    for _ in range(400):
        with socket.socket(socket.AF_UNIX) as s:
            t0 = time.perf_counter()
            s.connect(PATH)
            s.sendall(b"h")
            s.recv(100)
            t1 = time.perf_counter()
            s.sendall(b"h")
            s.recv(100)
            first.append(t1 - t0)
            second.append(time.perf_counter() - t1)
    first.sort()
    second.sort()
    print(f"{mode}: first reply {1e3 * first[200]:.3f} ms, second {1e3 * second[200]:.3f} ms")


def main(mode: str) -> None:
    """One mode per process: no thread of another mode's server is left running."""
    if os.path.exists(PATH):
        os.unlink(PATH)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(PATH)
    listener.listen(128)
    serve(mode, listener)
    proc = multiprocessing.get_context("fork").Process(target=client, args=(mode,))
    proc.start()
    proc.join()
    os.unlink(PATH)


if __name__ == "__main__":
    main(sys.argv[1])
