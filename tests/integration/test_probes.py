"""Health probes cannot be starved: while another uid attacks the metrics port, every
probe shaped like the kubelet's (a new connection, the request at once, a 3 s timeout:
deploy/kubernetes/kvoffloadd.yaml) is answered. The attacker connects from the probe's
own address, as any user of the node does when it reaches the pod's IP: per-peer caps
alone cannot tell them apart. Each attack prints one line (``pytest -s``): probes
answered, the slowest, and what the server did.

Before httpd.py's rules, 64 idle connections answered 0 of 32 probes, and the shipped
DaemonSet (3 failures x 10 s) would have restarted the daemon.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import pytest
from hostile import as_uid, fd_count, requires_root, rss_bytes

from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.server_process import free_port
from kvoffloadd.server.httpd import MAX_CONNECTIONS

PROBES = 32
PROBE_TIMEOUT_S = 3.0  # the DaemonSet's timeoutSeconds
PROBE = (
    b"GET /healthz HTTP/1.1\r\nHost: 10.0.0.7:9400\r\nUser-Agent: kube-probe/1.33\r\n"
    b"Accept: */*\r\nConnection: close\r\n\r\n"
)

Attack = Callable[[int, Callable[[], bool]], int]  # (port, stop?) -> connections made


def probe(port: int) -> float | None:
    """One kubelet-like probe: its duration if it got a 200 in time, else None."""
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as s:
            s.sendall(PROBE)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
                if time.monotonic() - t0 > PROBE_TIMEOUT_S:
                    return None
    except OSError:
        return None
    return time.monotonic() - t0 if data.startswith(b"HTTP/1.0 200") else None


def _connect(port: int, rcvbuf: int = 0, source: str = "127.0.0.1") -> socket.socket | None:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(1.0)
    try:
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def _closed(s: socket.socket) -> bool:
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(65536, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _hold(
    port: int,
    stop: Callable[[], bool],
    n: int,
    first: bytes = b"",
    then: bytes = b"",
    rcvbuf: int = 0,
    source: str = "127.0.0.1",
) -> int:
    """Keep ``n`` connections open, each sending ``first`` and then ``then`` every
    100 ms, reopening what the server closes; returns how many were opened."""
    socks: list[socket.socket] = []
    made = 0
    next_s = 0.0
    while not stop():
        for s in [s for s in socks if _closed(s)]:
            socks.remove(s)
            s.close()
        while len(socks) < n and (c := _connect(port, rcvbuf, source)) is not None:
            with contextlib.suppress(OSError):
                c.send(first)
            socks.append(c)
            made += 1
        if then and time.monotonic() > next_s:
            next_s = time.monotonic() + 0.1
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(then)
        time.sleep(0.01)
    for s in socks:
        s.close()
    return made


def idle(port: int, stop: Callable[[], bool]) -> int:
    return _hold(port, stop, 256)


def stalled_from_many_addresses(port: int, stop: Callable[[], bool]) -> int:
    """One byte of a request, then nothing, from 32 addresses: 8 each, 256 in all."""
    return _in_threads(
        [partial(_hold, port, stop, 8, first=b"G", source=f"127.0.1.{i + 1}") for i in range(32)]
    )


def slow_loris(port: int, stop: Callable[[], bool]) -> int:
    """Requests that never end: a header line every 100 ms, on 128 connections."""
    return _hold(port, stop, 128, first=b"GET /healthz HTTP/1.1\r\n", then=b"X-a: b\r\n")


def never_reading(port: int, stop: Callable[[], bool]) -> int:
    """Whole /metrics requests whose answers are never read, through tiny buffers."""
    return _hold(port, stop, 128, first=b"GET /metrics HTTP/1.0\r\n\r\n", rcvbuf=1024)


def connection_flood(port: int, stop: Callable[[], bool]) -> int:
    """Four threads connecting as fast as they can, holding the last 200 each."""

    def flood() -> int:
        held: list[socket.socket] = []
        made = 0
        while not stop():
            s = _connect(port)
            if s is None:
                continue
            made += 1
            held.append(s)
            if len(held) > 200:
                held.pop(0).close()
        for s in held:
            s.close()
        return made

    return _in_threads([flood] * 4)


def request_flood(port: int, stop: Callable[[], bool]) -> int:
    """Four threads asking for /metrics as fast as they can."""

    def ask() -> int:
        made = 0
        while not stop():
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=2) as s,
            ):
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                while s.recv(65536):
                    pass
                made += 1
        return made

    return _in_threads([ask] * 4)


def _in_threads(attacks: list[Callable[[], int]]) -> int:
    """Run each attack on its own thread; the connections they made, in all."""
    counts: list[int] = []
    threads = [threading.Thread(target=lambda a=a: counts.append(a())) for a in attacks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


ATTACKS: dict[str, Attack] = {
    "256 idle connections": idle,
    "256 stalled requests from 32 addresses": stalled_from_many_addresses,
    "128 slow-loris requests": slow_loris,
    "128 requests never reading their answers": never_reading,
    "a connection flood (4 threads)": connection_flood,
    "a /metrics request flood (4 threads)": request_flood,
}


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    requires_root()
    port = free_port()
    with DaemonProcess("64MiB", "--metrics-port", str(port), "--log-level", "error") as d:
        d.metrics_port = port  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while probe(port) is None:  # the loop's first publication
            assert time.monotonic() < deadline, "the daemon never answered /healthz"
            time.sleep(0.1)
        yield d
        assert d.alive(), "the daemon died"
        assert d.stop() == 0


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_probes_are_answered_under_attack(daemon: DaemonProcess, attack: str) -> None:
    port: int = daemon.metrics_port  # type: ignore[attr-defined]
    flag = tempfile.mkdtemp()
    os.chmod(flag, 0o755)
    stop_file = os.path.join(flag, "stop")
    made: list[int] = []
    fds0, rss0 = fd_count(daemon.pid), rss_bytes(daemon.pid)

    def attacker() -> None:
        fn = ATTACKS[attack]
        made.append(as_uid(lambda: fn(port, lambda: os.path.exists(stop_file))))

    t = threading.Thread(target=attacker)
    t.start()
    try:
        time.sleep(0.5)  # the attack takes hold
        fds_peak = fd_count(daemon.pid)
        times = []
        for _ in range(PROBES):
            times.append(probe(port))
            time.sleep(0.05)
        fds_peak = max(fds_peak, fd_count(daemon.pid))
        rss_peak = rss_bytes(daemon.pid)
    finally:
        open(stop_file, "w").close()
        t.join(60)
        shutil.rmtree(flag)
    answered = [x for x in times if x is not None]
    print(
        f"\n{attack}: {len(answered)}/{PROBES} probes answered, slowest "
        f"{max(answered, default=0) * 1000:.0f} ms; {made[0] if made else 0} attacking "
        f"connections; daemon descriptors {fds0} -> {fds_peak}, RSS "
        f"{rss0 >> 20} -> {rss_peak >> 20} MiB"
    )
    assert daemon.alive()
    assert len(answered) == PROBES, f"{attack}: {len(answered)}/{PROBES} probes answered"
    assert fds_peak <= fds0 + MAX_CONNECTIONS + 2  # the places, the reserve, one in hand
