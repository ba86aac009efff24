"""The loop's output: a connection that does not read its replies is paused, and
served again, everything it sent answered in order, once it has read.

A real ``Server`` and ``Service`` in this process (test_loop_clock's fixture), the
daemon's end of the connection given the kernel's smallest send buffer and the pause
threshold lowered, so a few thousand pings fill both.
"""

from __future__ import annotations

import select
import socket
from pathlib import Path

import msgspec
import pytest
from test_loop_clock import Clock, connected, loop  # noqa: F401 (loop: a fixture)

from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import HEADER_BYTES, frame_length
from kvoffloadd.server import output
from kvoffloadd.server import server as srv
from kvoffloadd.server.server import Server

PAUSE_BYTES = 8 << 10
PINGS = 4000  # of replies: more than the kernel's buffer and the pause threshold hold
_replies: msgspec.msgpack.Decoder[m.Reply] = msgspec.msgpack.Decoder(m.Reply)


def read_replies(sock: socket.socket, into: bytearray) -> list[m.Reply]:
    """The whole frames ``sock`` has to read now (non-blocking); a partial one stays
    in ``into``."""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        into += chunk
    out, at = [], 0
    while len(into) - at >= HEADER_BYTES:
        n = frame_length(into[at:])
        if len(into) - at < HEADER_BYTES + n:
            break
        out.append(_replies.decode(into[at + HEADER_BYTES : at + HEADER_BYTES + n]))
        at += HEADER_BYTES + n
    del into[:at]
    return out


def test_a_connection_that_does_not_read_is_paused_then_served_in_order_once_it_reads(
    loop: tuple[Server, Clock],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _ = loop
    monkeypatch.setattr(output, "PAUSE_OUTPUT_BYTES", PAUSE_BYTES)
    monkeypatch.setattr(srv, "PAUSE_OUTPUT_BYTES", PAUSE_BYTES)
    (sock,) = connected(server, tmp_path, 1)
    (c,) = server.clients.values()
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the kernel's least
    sock.sendall(b"".join(encode_frame(m.Ping(rid)) for rid in range(1, PINGS + 1)))
    for _ in range(200):
        server.turn(0.0)
    # Paused: replies past the threshold unsent, its socket no longer read, and the
    # requests it sent after them still waiting (nothing dropped, nothing served).
    assert len(c.outbuf) > PAUSE_BYTES
    assert not c.events & select.EPOLLIN and c.events & select.EPOLLOUT
    assert c.pending_bytes() > 0
    unsent = len(c.outbuf)
    server.turn(0.0)
    assert len(c.outbuf) == unsent  # nothing more is served while it does not read

    got: list[m.Reply] = []
    partial = bytearray()
    for _ in range(10 * PINGS):
        got += read_replies(sock, partial)
        if len(got) == PINGS:
            break
        server.turn(0.0)
    assert [type(r) for r in got] == [m.Pong] * PINGS
    assert [r.rid for r in got] == list(range(1, PINGS + 1))
    assert c.events == output.IN_ONLY and not c.outbuf  # read again, nothing owed
    assert server.clients == {c.session.session_id: c}  # served, never cut off
    sock.close()
    server.turn(0.0)
