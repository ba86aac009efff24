"""The machine's floor for one request over a unix socket, for ``make bench``.

A plain Python echo server (another process, one epoll loop and non-blocking socket
as the daemon's) and a blocking client: the round trip of a 40-byte message. The
daemon's ``ping`` cannot beat it, so the bench shows ping as a multiple of it: on a
virtual machine with slow wake-ups the floor alone can exceed the 30 us target.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

_SERVER = """
import selectors, socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen()
conn, _ = srv.accept()
conn.setblocking(False)
sel = selectors.EpollSelector()
sel.register(conn, selectors.EVENT_READ)
while True:
    for _key, _mask in sel.select():
        data = conn.recv(65536)
        if not data:
            sys.exit(0)
        conn.sendall(data)
"""


def echo_round_trip_us(n: int, deadline_s: float = 10.0) -> tuple[float, float]:
    """(p50, p99) in µs of ``n`` echo round trips to a fresh server process."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-echo-") as tmp:
        path = os.path.join(tmp, "echo.sock")
        server = subprocess.Popen([sys.executable, "-c", _SERVER, path])
        try:
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            end = time.monotonic() + deadline_s
            while True:
                try:
                    client.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > end or server.poll() is not None:
                        raise RuntimeError("the echo server did not start") from None
                    time.sleep(0.01)
            message = b"x" * 40
            took = []
            for _ in range(n):
                t0 = time.perf_counter()
                client.sendall(message)
                got = 0
                while got < len(message):
                    got += len(client.recv(65536))
                took.append(time.perf_counter() - t0)
            client.close()
            server.wait(timeout=deadline_s)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    took.sort()
    return took[len(took) // 2] * 1e6, took[min(len(took) - 1, int(0.99 * len(took)))] * 1e6
