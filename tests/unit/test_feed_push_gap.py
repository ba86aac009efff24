"""Feed pushes, at most one per connection per ``FEED_PUSH_GAP_S``.

An engine reads what the daemon pushed once per step's I/O; one push per loop turn
that moved its feed made it decode and apply three or four pushes per read. A real
``Server`` and ``Service`` in this process on the loop clock's fake (test_loop_clock):
a subscriber mirrors a namespace by push, its feed moves in turn after turn (events as
a completed store emits them), and the subscriber gets its first push at once, nothing
more within the gap, then everything since in one push.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
from test_loop_clock import Clock, connected, loop  # noqa: F401 (loop: a fixture)

from kvoffload.plans import OffloadEvent
from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.connection import HEADER_BYTES, frame_length
from kvoffload.protocol.packing import unpack_keys
from kvoffloadd.server.output import FEED_PUSH_GAP_S
from kvoffloadd.server.server import Server

LAYOUT = m.KVLayout([4096])
_replies: msgspec.msgpack.Decoder[m.Reply] = msgspec.msgpack.Decoder(m.Reply)


def frames(sock: socket.socket) -> list[m.Reply]:
    """Every whole frame ``sock`` has to read now (non-blocking)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    out, at = [], 0
    while at < len(data):
        n = frame_length(data[at:])
        out.append(_replies.decode(data[at + HEADER_BYTES : at + HEADER_BYTES + n]))
        at += HEADER_BYTES + n
    assert at == len(data)
    return out


def ask(server: Server, sock: socket.socket, req: m.Request) -> list[m.Reply]:
    sock.sendall(encode_frame(req))
    server.turn(0.0)
    return frames(sock)


def opened(server: Server, sock: socket.socket, rid: int) -> int:
    got = ask(server, sock, m.OpenNamespace(rid, "gap", LAYOUT))
    assert isinstance(got[-1], m.NamespaceOpened)
    return got[-1].ns


def stored(server: Server, ns: int, key: bytes) -> None:
    """A store's event in the namespace's feed (what a completed store emits), then a
    loop turn."""
    server.service.namespaces[ns].events.emit(OffloadEvent([key], False, [1]))
    server.turn(0.0)


def feed_keys(pushes: list[m.Reply]) -> list[bytes]:
    keys = []
    for p in pushes:
        assert isinstance(p, m.FeedPush)
        for e in p.events:
            keys += unpack_keys(e.keys, e.key_bytes)
    return keys


def test_a_connections_feed_is_pushed_at_most_once_per_gap(
    loop: tuple[Server, Clock],  # noqa: F811
    tmp_path: Path,
) -> None:
    server, clock = loop
    (mirror,) = connected(server, tmp_path, 1)
    ns = opened(server, mirror, 2)
    synced = ask(server, mirror, m.SyncKeys(3, ns, push=True))
    assert isinstance(synced[-1], m.KeysPage)

    stored(server, ns, b"key-0000")  # the first: pushed at once
    pushes = frames(mirror)
    assert [type(p) for p in pushes] == [m.FeedPush]
    assert feed_keys(pushes) == [b"key-0000"]

    for i in range(1, 4):  # three more, each in a turn of its own, within the gap
        stored(server, ns, b"key-%04d" % i)
        assert frames(mirror) == []
    assert server._push_due  # held back, so the loop wakes for it

    clock.advance(FEED_PUSH_GAP_S)
    server.turn(0.0)
    pushes = frames(mirror)
    assert len(pushes) == 1  # all three in one push
    assert feed_keys(pushes) == [b"key-0001", b"key-0002", b"key-0003"]
    assert not server._push_due
    mirror.close()
    server.turn(0.0)
