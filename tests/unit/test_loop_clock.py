"""The loop's clock: one reading ends a unit of work and starts the next, so a
connection is charged its own requests' loop time and never work that is no unit
(a completion handler, a flush, a read that was only queued).

A real ``Server`` and ``Service`` in this process on a fake clock that moves a
microsecond per reading; a watched descriptor's handler that "takes" a whole second
runs first in a turn, then a client's ping is served in the same turn; and requests
served as they are read stop once a turn's budget is spent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.server import ready as readyshare
from kvoffloadd.server import server as srv
from kvoffloadd.server.admission import REAPER
from kvoffloadd.server.listener import bind_listener
from kvoffloadd.server.server import INLINE_BYTES, Server
from kvoffloadd.server.slowturns import LOG_GAP_S, SlowTurns
from kvoffloadd.service.budgets import TURN_S
from kvoffloadd.service.service import Service

HANDLER_S = 1.0  # what the handler's work costs on the fake clock
OTHER_UID = 65534  # a connection of another uid (its session says so)


class Clock:
    """Moves a microsecond per reading; ``advance`` stands for work taking time."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.readings = 0

    def __call__(self) -> float:
        self.now_s += 1e-6
        self.readings += 1
        return self.now_s

    def advance(self, s: float) -> None:
        self.now_s += s


class FirstFd:
    """The loop's epoll, reporting ``first`` ahead of the other ready descriptors."""

    def __init__(self, ep: select.epoll, first: int) -> None:
        self._ep, self._first = ep, first

    def poll(self, timeout_s: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        ready = self._ep.poll(timeout_s, maxevents)
        return sorted(ready, key=lambda fe: fe[0] != self._first)

    def __getattr__(self, name: str) -> object:
        return getattr(self._ep, name)


class LastFd(FirstFd):
    """The loop's epoll, with ``first`` behind every other ready descriptor: only what
    ``maxevents`` leaves room for is handed over (the rest stays ready, as in epoll's
    own list)."""

    def poll(self, timeout_s: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        ready = sorted(self._ep.poll(timeout_s, 1 << 16), key=lambda fe: fe[0] == self._first)
        return ready if maxevents < 0 else ready[:maxevents]


@pytest.fixture
def loop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Server, Clock]]:
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    cfg = msgspec.convert(
        {"instance": f"c{uuid.uuid4().hex[:8]}", "region_size": "16MiB", "extent_size": "1MiB"},
        DaemonConfig,
    ).validate()
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, 1 << 20, 4096))
    copier = CpuCopier(1)
    server = Server(Service(cfg, region, copier), bind_listener(str(tmp_path / "s.sock")))
    yield server, clock
    server.close()
    server.listener.close()
    copier.close()
    region.close()


def test_a_unit_is_charged_its_own_time_not_a_handler_that_ran_before_it_in_the_turn(
    loop: tuple[Server, Clock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, clock = loop
    monkeypatch.setattr(srv, "TURN_S", 2 * HANDLER_S)  # the ping is still served as read
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(tmp_path / "s.sock"))
    server.turn(0.0)  # accepted
    client.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "clock", os.getpid())))
    server.turn(0.0)
    assert client.recv(65536)  # the Welcome

    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)

    def slow_handler(events: int) -> None:
        wake_r.recv(16)
        clock.advance(HANDLER_S)

    server._watch(wake_r.fileno(), slow_handler)
    server._epoll = FirstFd(server._epoll, wake_r.fileno())  # type: ignore[assignment]
    charged: list[tuple[int, float]] = []
    turns: list[float] = []
    served = server.turns.served

    def record_served(conn: int, cost_s: float, *args: object) -> None:
        charged.append((conn, cost_s))
        served(conn, cost_s, *args)  # type: ignore[arg-type]

    server.turns.served = record_served  # type: ignore[method-assign,assignment]
    server._record_turn = turns.append  # type: ignore[assignment]
    woken: list[int] = []
    wake = server.turns.wake

    def record_wake(conn: int, *args: object) -> None:
        woken.append(conn)
        wake(conn, *args)  # type: ignore[arg-type]

    server.turns.wake = record_wake  # type: ignore[method-assign,assignment]

    wake_w.send(b"x")
    client.sendall(encode_frame(m.Ping(2)))
    server.turn(0.0)
    assert client.recv(65536)  # the Pong, served in the same turn as the handler

    assert turns and turns[-1] >= HANDLER_S  # the turn took the handler's second
    assert len(charged) == 1
    assert 0 < charged[0][1] < HANDLER_S / 1000  # the ping paid for itself alone
    assert not woken  # served as it was read, not through the queue
    for s in (client, wake_r, wake_w):
        s.close()
    server.turn(0.0)  # the client's hang-up


def connected(server: Server, tmp_path: Path, n: int) -> list[socket.socket]:
    """``n`` clients past their Hello, non-blocking."""
    clients = []
    for i in range(n):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(tmp_path / "s.sock"))
        server.turn(0.0)  # accepted
        c.sendall(encode_frame(m.Hello(1, m.PROTOCOL_VERSION, f"c{i}", os.getpid())))
        server.turn(0.0)
        assert c.recv(65536)  # the Welcome
        c.setblocking(False)
        clients.append(c)
    return clients


def answered(clients: list[socket.socket]) -> int:
    """How many of ``clients`` have a reply to read (read and dropped)."""
    n = 0
    for c in clients:
        with contextlib.suppress(BlockingIOError):
            n += bool(c.recv(65536))
    return n


def test_requests_served_as_they_are_read_stop_at_the_turns_budget(
    loop: tuple[Server, Clock], tmp_path: Path
) -> None:
    """Each of six clients sends one small request in the same turn, each taking 40% of
    the turn's budget: the turn serves them as they are read until its budget is
    spent, then queues the rest (and serves one of them, as a turn always serves one
    queued unit); the next turns serve the others. Nothing is lost, and no turn does
    much more than its budget, however many clients are ready."""
    server, clock = loop
    clients = connected(server, tmp_path, 6)
    handlers = server.service._handlers
    pong = handlers[m.Ping]

    def slow_ping(s: object, r: m.Ping) -> m.Reply | None:
        clock.advance(0.4 * TURN_S)
        return pong(s, r)  # type: ignore[arg-type]

    handlers[m.Ping] = slow_ping
    turns: list[float] = []
    server._record_turn = turns.append  # type: ignore[assignment]
    frame = encode_frame(m.Ping(2))
    assert len(frame) <= INLINE_BYTES  # each would be served as it is read
    for c in clients:
        c.sendall(frame)

    server.turn(0.0)
    first = answered(clients)
    assert first == 4  # three as they were read (the third spent the budget), one queued
    assert turns[-1] < 1.7 * TURN_S
    got, deadline = first, time.monotonic() + 10
    while got < len(clients):
        assert time.monotonic() < deadline, f"{got} of {len(clients)} pings answered"
        server.turn(0.0)
        got += answered(clients)
        assert turns[-1] < 1.7 * TURN_S
    for c in clients:
        c.close()
    server.turn(0.0)  # the hang-ups


def test_a_queued_unit_is_charged_the_loop_threads_cpu_time_not_the_cpu_the_kernel_took(
    loop: tuple[Server, Clock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit served from the queue, during which the kernel ran something else for
    4 ms (the wall clock moves, the loop thread's CPU clock barely does), is charged
    the CPU time: charged the 4 ms, a light client lands behind every connection of its
    uid that has used less than that (a round of 31 connections' units: 100 ms)."""
    server, clock = loop
    cpu = Clock()
    monkeypatch.setattr(time, "thread_time", cpu)
    (client,) = connected(server, tmp_path, 1)
    handlers = server.service._handlers
    pong = handlers[m.Ping]

    def preempted_ping(s: object, r: m.Ping) -> m.Reply | None:
        clock.advance(0.004)
        cpu.advance(30e-6)
        return pong(s, r)  # type: ignore[arg-type]

    handlers[m.Ping] = preempted_ping
    charged: list[float] = []
    served = server.turns.served

    def record_served(conn: int, cost_s: float, *args: object) -> None:
        charged.append(cost_s)
        served(conn, cost_s, *args)  # type: ignore[arg-type]

    server.turns.served = record_served  # type: ignore[method-assign,assignment]
    client.sendall(encode_frame(m.Ping(2)) + encode_frame(m.Ping(3)))
    server.turn(0.0)  # the first served as read (nobody waits), the second queued
    assert answered([client]) == 1
    assert len(charged) == 2
    assert charged[0] >= 0.004  # served as read: wall time
    assert 30e-6 <= charged[1] < 100e-6  # from the queue: the loop thread's CPU time

    # Short units, not paused, share one reading of the CPU clock (a system call).
    handlers[m.Ping] = pong
    readings = cpu.readings
    client.sendall(b"".join(encode_frame(m.Ping(rid)) for rid in range(4, 54)))
    server.turn(0.0)
    assert cpu.readings - readings <= 2
    assert all(0 < cost_s < 100e-6 for cost_s in charged[2:])
    client.close()
    server.turn(0.0)  # the hang-up


def test_a_slow_turn_is_logged_with_where_its_time_went_once_per_gap(
    loop: tuple[Server, Clock],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two pings that each hold the loop 60 ms, 1 ms of it on a CPU (the kernel ran
    something else): the first is served as it is read, the second from the queue.
    One warning says the turn's time, the reads', the queued units', how little of it
    the loop thread ran and whose unit was longest; a slow turn within ``LOG_GAP_S`` of
    that line is not told but counted in the next one."""
    server, clock = loop
    cpu, gap_clock = Clock(), Clock()
    monkeypatch.setattr(time, "thread_time", cpu)
    server.slow_turns = SlowTurns(server.admission.describe, clock=gap_clock, cpu_clock=cpu)
    (client,) = connected(server, tmp_path, 1)
    (cid,) = server.clients
    handlers = server.service._handlers
    pong = handlers[m.Ping]

    def held_ping(s: object, r: m.Ping) -> m.Reply | None:
        clock.advance(0.060)
        cpu.advance(0.001)
        return pong(s, r)  # type: ignore[arg-type]

    handlers[m.Ping] = held_ping
    two = encode_frame(m.Ping(2)) + encode_frame(m.Ping(3))
    with caplog.at_level(logging.WARNING, "kvoffloadd.server.slowturns"):
        client.sendall(two)
        server.turn(0.0)
        (line,) = caplog.messages
        assert line.startswith("loop turn took 120.")
        assert "1 ready descriptors handled in 60." in line
        assert "1 queued units served in 60." in line
        assert "the loop thread on a CPU 1.0 ms of it" in line
        assert f"longest 60.0 ms, client {cid} (pid {os.getpid()} uid {os.getuid()})" in line
        assert "more slow turns" not in line

        client.sendall(two)
        server.turn(0.0)
        assert len(caplog.messages) == 1  # within the gap: counted, not told
        gap_clock.advance(LOG_GAP_S)
        client.sendall(two)
        server.turn(0.0)
        assert len(caplog.messages) == 2
        assert caplog.messages[1].endswith("; 1 more slow turns since the last such line")
    assert server.slow_turns.total == 3
    assert answered([client]) == 1  # all six pongs, read at once
    client.close()
    server.turn(0.0)  # the hang-up


def test_a_turn_reads_at_most_its_share_of_ready_clients_and_the_rest_come_next(
    loop: tuple[Server, Clock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epoll hands a turn at most ``READY_PER_TURN`` descriptors (two here), round
    robin: four clients' pings are answered two per turn."""
    server, _clock = loop
    clients = connected(server, tmp_path, 4)
    monkeypatch.setattr(readyshare, "READY_PER_TURN", 2)
    for c in clients:
        c.sendall(encode_frame(m.Ping(2)))
    server.turn(0.0)
    assert answered(clients) == 2
    server.turn(0.0)
    assert answered(clients) == 2
    for c in clients:
        c.close()
    deadline = time.monotonic() + 10
    while server.clients:  # the hang-ups, two a turn
        assert time.monotonic() < deadline
        server.turn(0.0)


def test_a_turn_shares_its_reads_among_uids_when_more_are_ready_than_it_reads(
    loop: tuple[Server, Clock], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More connections are ready than a turn reads (``READY_PER_TURN``, four here):
    six of one uid ready before one of another, the turn reads two of each uid's, the
    other uid's included (epoll alone hands over the oldest four, all of the first
    uid's: 1,000 hang-ups of one uid held another's ping behind all of them); the rest
    are read in the next turn, oldest first, and nothing is read twice or lost."""
    server, _clock = loop
    clients = connected(server, tmp_path, 7)
    other = list(server.clients.values())[-1]
    other.session.uid = OTHER_UID
    monkeypatch.setattr(readyshare, "READY_PER_TURN", 4)
    server._epoll = LastFd(server._epoll, other.fd)  # type: ignore[assignment]
    frame = encode_frame(m.Ping(2))
    for c in clients:
        c.sendall(frame)
    server.turn(0.0)
    first = [bool(n) for n in map(answered, ([c] for c in clients))]
    assert first[-1], "the other uid's connection waited behind the first uid's"
    assert sum(first) == 4 and len(server._ready.pending) == 3
    server.turn(0.0)
    second = [bool(n) for n in map(answered, ([c] for c in clients))]
    assert second == [not f for f in first] and not server._ready.pending
    for c in clients:
        c.close()
    deadline = time.monotonic() + 10
    while server.clients:
        assert time.monotonic() < deadline
        server.turn(0.0)
    assert not server._ready.pending and not server._ready._waiting


def test_connections_that_hang_up_during_their_first_request_leave_nothing_in_the_loops_book(
    loop: tuple[Server, Clock], tmp_path: Path
) -> None:
    """Connect, send Hello, hang up before the Welcome: the reply's send fails and the
    connection is dropped inside its own unit. Repeated, it must not grow the turn
    queue's book (its uid is charged; nothing of the connection is kept)."""
    server, _clock = loop
    hello = encode_frame(m.Hello(1, m.PROTOCOL_VERSION, "gone", os.getpid()))
    for _ in range(50):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(tmp_path / "s.sock"))
        server.turn(0.0)  # accepted
        c.sendall(hello)
        c.close()
        server.turn(0.0)  # read, served, the Welcome's send fails: dropped
    assert not server.clients
    book = server.turns
    assert set(book._usage) <= {REAPER}  # the release of what they held: one id for all
    assert not book._uid_of and not book.queued


class SlowHousekeeping(Service):
    """Housekeeping that takes 2 ms of the loop, then stops it."""

    server: Server

    def cron(self) -> bool:
        end_s = time.perf_counter() + 0.002
        while time.perf_counter() < end_s:
            pass
        self.server._stop = True
        return super().cron()


def test_housekeeping_counts_in_the_loop_turn_histogram(tmp_path: Path) -> None:
    """A client waits behind housekeeping as behind any turn: its time is a turn's."""
    cfg = DaemonConfig(instance=f"f{uuid.uuid4().hex[:8]}", region_size="16MiB")
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(16 << 20, 2 << 20, 16384))
    copier = CpuCopier(1)
    service = SlowHousekeeping(cfg, region, copier)
    server = service.server = Server(service, bind_listener(str(tmp_path / "s.sock")))
    server.heartbeat.period_s = 0.001
    try:
        server.serve_forever()  # nobody connects: housekeeping is the only work
        assert service.loop.turns_total == 1 and service.loop.max_s >= 0.002
    finally:
        server.listener.close()
        copier.close()
        region.close()
