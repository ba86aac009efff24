"""/healthz and /readyz decide from the stats the loop publishes: the reasons a probe
sees, without a daemon (the live endpoint is tested in test_operations); and the HTTP
server keeps a place for them whatever other peers hold (attacks on a live daemon:
tests/integration/test_probes.py)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from kvoffloadd.server.httpd import MAX_CONNECTIONS, MAX_PER_PEER, HttpServer
from kvoffloadd.server.metrics import HEALTH_STALE_S, MetricsEndpoint, readiness


def stats(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "server": {"shutting_down": False},
        "region": {"prefaulted_bytes": 100, "data_bytes": 100},
        "gpu": {"enabled": False},
    }
    for section, fields in over.items():
        base[section] = {**base[section], **fields}
    return base


def test_readiness_names_what_is_pending() -> None:
    assert readiness(stats()) == []
    assert readiness(stats(region={"prefaulted_bytes": 25})) == ["pre-faulting the region (25%)"]
    pinning = {"enabled": True, "pinned_bytes": 10, "pin_target_bytes": 100, "pin_error": ""}
    assert readiness(stats(gpu=pinning)) == ["pinning the region (10 of 100)"]
    failed = dict(pinning, pin_error="cuMemHostRegister: out of memory")
    assert readiness(stats(gpu=failed)) == []  # failed pinning is reported, not waited for
    assert readiness(stats(server={"shutting_down": True})) == ["shutting down"]


def test_probes_answer_503_with_the_reason_until_the_loop_publishes() -> None:
    ep = MetricsEndpoint("127.0.0.1", 0)
    try:
        status, _, body = ep._healthz()
        assert status == 503 and not json.loads(body)["alive"]
        status, _, body = ep._readyz()
        assert status == 503 and json.loads(body)["pending"] == ["starting"]
        full = stats(region={"prefaulted_bytes": 50})
        full |= {"copies": {"stored_bytes_total": 0, "loaded_bytes_total": 0}}
        ep._last, ep._published_s = full, time.monotonic()  # just published
        status, _, body = ep._healthz()
        assert status == 200 and json.loads(body)["alive"]
        status, _, body = ep._readyz()
        assert status == 503 and json.loads(body)["pending"] == ["pre-faulting the region (50%)"]
        ep._published_s = -HEALTH_STALE_S  # the loop stopped turning
        status, _, body = ep._healthz()
        assert status == 503 and "has not turned" in json.loads(body)["reason"]
    finally:
        ep.close()


def _stalled(port: int, source: str) -> socket.socket:
    """A connection that sent one byte of a request and nothing more."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"G")
    return s


def _closed_by_server(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _get(port: int, path: str = "/healthz") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data


def poll(predicate: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[HttpServer]:
    srv = HttpServer("127.0.0.1", 0, {"/healthz": lambda: (200, "text/plain", b"ok\n")})
    yield srv
    srv.close()


def test_one_peer_holds_at_most_its_share_and_the_oldest_goes_first(server: HttpServer) -> None:
    """Three rounds of stalled requests from one address, a probe from it between
    them (the server turns): each round replaces the one before. A round is in once
    the server holds all of it: a connection of the round before that the kernel
    queued late (a busy machine) would otherwise be accepted in the same turn as this
    round's, and one accepted in this very turn is never replaced."""

    def moved_in(n: int) -> bool:
        replaced = server.evicted_total >= n * MAX_PER_PEER
        return replaced and server.open_connections == MAX_PER_PEER

    socks: list[socket.socket] = []
    try:
        for n in range(3):
            socks += [_stalled(server.port, "127.0.0.1") for _ in range(MAX_PER_PEER)]
            poll(partial(moved_in, n), f"round {n} to move in")
            assert _get(server.port).startswith(b"HTTP/1.0 200")  # from the same address
        closed = [_closed_by_server(s) for s in socks]
        assert all(closed[: 2 * MAX_PER_PEER]) and not any(closed[-MAX_PER_PEER:])
        assert server.shed_total == 0
    finally:
        for s in socks:
            s.close()


def test_all_places_taken_by_many_peers_still_leave_room_for_a_probe(server: HttpServer) -> None:
    peers = 2 * MAX_CONNECTIONS // MAX_PER_PEER
    socks = [
        _stalled(server.port, f"127.0.2.{i + 1}") for i in range(peers) for _ in range(MAX_PER_PEER)
    ]
    try:
        poll(lambda: server.evicted_total >= MAX_CONNECTIONS, "room made for newcomers")
        assert sum(not _closed_by_server(s) for s in socks) <= MAX_CONNECTIONS
        for _ in range(8):
            assert _get(server.port).startswith(b"HTTP/1.0 200")
        assert server.shed_total == 0  # nobody was refused for room
    finally:
        for s in socks:
            s.close()
