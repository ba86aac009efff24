"""The machine's floor for one request over a unix socket, for ``make bench``.

A plain Python echo server (another process, one epoll loop and non-blocking socket
as the daemon's) and a blocking client: the round trip of a 40-byte message. The
daemon's ``ping`` cannot beat it, so the bench shows ping as a multiple of it: on a
virtual machine with slow wake-ups the floor alone can exceed the 30 us target.
``interleaved`` times the echo and the call it is the floor of in alternating blocks,
so that what a neighbour on the machine does hits both alike (DESIGN.md section 6:
ping p50 <= 1.3 x the echo in the same run).

``placed`` pins the client and the servers for a measurement, the same way for the
floor and the daemon. Left to the scheduler, one server would share the client's CPU
and another not, and on a virtual machine a wake-up on another CPU can cost several
times a whole round trip on one (measured: 2 vCPUs, echo p50 20 us on one CPU, 110-180
us across two), so the ratio said where the scheduler put each, not what either costs.
On one CPU a round trip is the client's and the server's work plus two switches: the
cost of the work. Across two it adds the machine's cross-CPU wake-up to both.

``WIRE_SERVER`` is the same loop doing the daemon's wire work per request and nothing
else (``recvmsg_into`` with room for descriptors, msgspec's decode of the request and
encode of a ``Pong``, one send): what any Python daemon pays per request, so that a
ping's distance from the echo splits into the wire's part and the daemon's own.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

from kvoffload.protocol import encode_frame
from kvoffload.protocol.messages import Ping, Pong

_ACCEPT = """
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen()
conn, _ = srv.accept()
conn.setblocking(False)
"""  # a server's one connection, on the socket path it is given

_SERVER = (
    _ACCEPT
    + """
import selectors
sel = selectors.EpollSelector()
sel.register(conn, selectors.EVENT_READ)
while True:
    for _key, _mask in sel.select():
        data = conn.recv(65536)
        if not data:
            sys.exit(0)
        conn.sendall(data)
"""
)

WIRE_SERVER = (
    _ACCEPT
    + """
import select, struct
import msgspec
from kvoffload.protocol import messages as m
from kvoffloadd.server.server import _ANC_BYTES
decode = msgspec.msgpack.Decoder(m.Request).decode
encode_into = msgspec.msgpack.Encoder().encode_into
length = struct.Struct("<I")
ep = select.epoll()
ep.register(conn.fileno(), select.EPOLLIN)
rbuf = bytearray(65536)
rview, rbufs, out = memoryview(rbuf), [memoryview(rbuf)], bytearray()
while True:
    for _fd, _ev in ep.poll(-1, 64):
        n, _anc, _flags, _ = conn.recvmsg_into(rbufs, _ANC_BYTES)
        if not n:
            sys.exit(0)
        req = decode(rview[4:n])
        out.clear()
        out += bytes(4)
        encode_into(m.Pong(req.rid), out, -1)
        length.pack_into(out, 0, len(out) - 4)
        conn.send(out)
"""
)

PING_FRAME = encode_frame(Ping(2))  # what the wire loop is sent, and a raw ping
PONG_BYTES = len(encode_frame(Pong(2)))  # what it answers


class EchoPeer:
    """A fresh server process (by default the echo) and a blocking connection to it:
    ``round_trip`` sends ``message`` and reads ``reply_bytes`` (default: as many)."""

    MESSAGE = b"x" * 40

    def __init__(
        self,
        deadline_s: float = 10.0,
        code: str = _SERVER,
        message: bytes = MESSAGE,
        reply_bytes: int = 0,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvoffload-echo-")
        path = os.path.join(self._tmp.name, "echo.sock")
        self.deadline_s = deadline_s
        self.message, self.reply_bytes = message, reply_bytes or len(message)
        self.proc = subprocess.Popen([sys.executable, "-c", code, path])
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        end = time.monotonic() + deadline_s
        try:
            while True:
                try:
                    self.sock.connect(path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if time.monotonic() > end or self.proc.poll() is not None:
                        raise RuntimeError("the echo server did not start") from None
                    time.sleep(0.01)
        except BaseException:
            self.close()
            raise
        self._buf = bytearray(65536)

    def round_trip(self) -> None:
        self.sock.sendall(self.message)
        got = 0
        while got < self.reply_bytes:
            n = self.sock.recv_into(self._buf)
            if not n:
                raise ConnectionError("the server closed the connection")
            got += n

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=self.deadline_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._tmp.cleanup()


def interleaved(
    fns: dict[str, Callable[[], object]], n: int, block: int = 200
) -> dict[str, list[float]]:
    """``n`` latencies (seconds) of each of ``fns``, timed in alternating blocks of
    ``block`` calls."""
    took: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(max(1, n // block)):
        for name, fn in fns.items():
            out = took[name]
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return took


def percentiles_us(took: list[float]) -> tuple[float, float]:
    """(p50, p99) in µs."""
    took = sorted(took)
    return took[len(took) // 2] * 1e6, took[min(len(took) - 1, int(0.99 * len(took)))] * 1e6


def wire_peer(deadline_s: float = 10.0) -> EchoPeer:
    """A fresh bare wire loop (``WIRE_SERVER``), sent raw pings."""
    return EchoPeer(deadline_s, WIRE_SERVER, PING_FRAME, PONG_BYTES)


def echo_round_trip_us(n: int, deadline_s: float = 10.0) -> tuple[float, float]:
    """(p50, p99) in µs of ``n`` echo round trips to a fresh server process."""
    peer = EchoPeer(deadline_s)
    try:
        return percentiles_us(interleaved({"echo": peer.round_trip}, n, n)["echo"])
    finally:
        peer.close()


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def placed(server_pids: Sequence[int], apart: bool) -> Iterator[bool]:
    """Pin the calling thread to one CPU and every thread of ``server_pids`` to the same
    CPU (``apart`` False) or to another (True); put everything back afterwards. Yields
    whether the placement was made (apart needs two CPUs this process may use)."""
    allowed = sorted(os.sched_getaffinity(0))
    if apart and len(allowed) < 2:
        yield False
        return
    mine = allowed[0]
    theirs = allowed[1] if apart else mine
    saved: list[tuple[int, set[int]]] = [(0, set(allowed))]
    try:
        os.sched_setaffinity(0, {mine})
        for pid in server_pids:
            for tid in _threads(pid):
                with contextlib.suppress(ProcessLookupError):
                    saved.append((tid, os.sched_getaffinity(tid)))
                    os.sched_setaffinity(tid, {theirs})
        yield True
    finally:
        for tid, cpus in saved:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, cpus)
