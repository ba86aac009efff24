"""The raw RESP reader of the Redis tier against a scripted server on a unix socket:
bulk replies land in the caller's memory, whatever the packet boundaries; anything
else fails that reply or the connection, never the process."""

from __future__ import annotations

import array
import contextlib
import pathlib
import re
import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvoffloadd.tiers.resp import (
    IOV_PARTS,
    MAX_LINE_BYTES,
    MIN_SEND_BYTES_PER_S,
    RespConnection,
    RespError,
    check_url,
    encode,
    encode_head,
)


class Scripted:
    """Accepts one connection, records what it is sent, answers with ``replies`` in
    pieces of ``piece`` bytes (to split headers and bodies across reads)."""

    def __init__(self, path: pathlib.Path, replies: bytes, expect_bytes: int, piece: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.received = b""
        self._t = threading.Thread(target=self._serve, args=(replies, expect_bytes, piece))
        self._t.start()

    def _serve(self, replies: bytes, expect_bytes: int, piece: int) -> None:
        conn, _ = self.sock.accept()
        with conn:
            while len(self.received) < expect_bytes:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                self.received += chunk
            for i in range(0, len(replies), piece):
                conn.sendall(replies[i : i + piece])
            conn.recv(1)  # until the client closes

    def close(self) -> None:
        self._t.join(10)
        self.sock.close()


@pytest.fixture
def sock_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "r.sock"


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_a_bulk_reply_lands_in_the_view_whatever_the_packets(
    sock_path: pathlib.Path, piece: int
) -> None:
    block = bytes(range(256)) * 64  # 16 KiB
    replies = b"*2\r\n$3\r\nhdr\r\n$%d\r\n%s\r\n:1\r\n" % (len(block), block)
    cmd = encode("HMGET", "k", "m", "d")
    server = Scripted(sock_path, replies, len(cmd), piece)
    c = RespConnection(f"unix://{sock_path}", 5.0)
    c.send([cmd])
    out = bytearray(len(block))
    assert c.read_array_header() == 2
    assert c.read() == b"hdr"
    assert c.read_into(memoryview(out)) is True
    assert bytes(out) == block and c.read() == 1
    assert server.received == cmd
    c.close()
    server.close()


def test_other_lengths_nil_and_error_replies(sock_path: pathlib.Path) -> None:
    replies = b"$5\r\nshort\r\n$-1\r\n-WRONGTYPE not a hash\r\n+OK\r\n"
    server = Scripted(sock_path, replies, 1, 3)
    c = RespConnection(f"unix://{sock_path}", 5.0)
    c.send([encode("PING")])
    out = bytearray(8)
    assert c.read_into(memoryview(out)) is False and out == bytearray(8)  # dropped
    assert c.read_into(memoryview(out)) is None  # nil: the key is gone
    err = c.read_array_header()
    assert isinstance(err, RespError) and "WRONGTYPE" in str(err)
    assert c.read() == b"OK"  # the connection is still in step
    c.close()
    server.close()


def test_huge_foreign_values_are_dropped_without_buffering_them(sock_path: pathlib.Path) -> None:
    huge = 3 << 20  # past MAX_BUFFERED_BYTES, and not the block's length
    replies = b"$%d\r\n%s\r\n$%d\r\n%s\r\n:7\r\n" % (huge, bytes(huge), huge, bytes(huge))
    server = Scripted(sock_path, replies, 1, 1 << 16)
    c = RespConnection(f"unix://{sock_path}", 5.0)
    c.send([encode("PING")])
    err = c.read()
    assert isinstance(err, RespError) and "byte value" in str(err)
    assert c.read_into(memoryview(bytearray(16))) is False
    assert c.read() == 7 and len(c._buf) < (1 << 20)  # in step, nothing held
    c.close()
    server.close()


def test_garbage_closes_the_connection_with_a_clear_error(sock_path: pathlib.Path) -> None:
    server = Scripted(sock_path, b"$3\r\nabcXY", 1, 64)  # a bulk without its CRLF
    c = RespConnection(f"unix://{sock_path}", 5.0)
    c.send([encode("PING")])
    with pytest.raises(RespError, match=r"CRLF|RESP"):
        c.read_into(memoryview(bytearray(3)))
    with pytest.raises(OSError, match="not connected"):
        c.read()
    server.close()


def test_auth_and_select_come_from_the_url() -> None:
    """A TCP URL with a user, password and database: AUTH and SELECT go first."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while data.count(b"\r\n") < 12:  # AUTH (4 parts) and SELECT (3 parts)
                data += conn.recv(4096)
            seen.append(data)
            conn.sendall(b"+OK\r\n+OK\r\n")
            conn.recv(1)

    t = threading.Thread(target=serve)
    t.start()
    c = RespConnection(f"redis://app:s%40cret@127.0.0.1:{port}/3", 5.0)
    c.send([])
    assert seen[0] == encode("AUTH", "app", "s@cret") + encode("SELECT", "3")
    c.close()
    t.join(10)
    listener.close()


class Streaming:
    """Accepts one connection, reads the command, then lets ``feed`` write whatever it
    likes until the client goes away or the test ends."""

    def __init__(
        self, path: pathlib.Path, feed: Callable[[socket.socket, threading.Event], object]
    ):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.stop = threading.Event()
        self._t = threading.Thread(target=self._serve, args=(feed,), daemon=True)
        self._t.start()

    def _serve(self, feed: Callable[[socket.socket, threading.Event], object]) -> None:
        conn, _ = self.sock.accept()
        with conn, contextlib.suppress(OSError):  # the client closed: done
            conn.recv(65536)
            feed(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        self._t.join(10)
        self.sock.close()


def endless(head: bytes, chunk: bytes) -> Callable[[socket.socket, threading.Event], None]:
    def feed(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head)
        while not stop.is_set():
            conn.sendall(chunk)

    return feed


def trickle(head: bytes) -> Callable[[socket.socket, threading.Event], None]:
    def feed(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(head)
        while not stop.wait(0.02):  # a byte well within every read's timeout
            conn.sendall(b"x")

    return feed


@pytest.mark.parametrize(
    ("feed", "error"),
    [
        (endless(b"+", b"x" * 65536), "a line longer than"),
        (endless(b"*70000\r\n", b":1\r\n" * 1000), "more than 65536 elements"),
        (endless(b"*2\r\n*40000\r\n" + b":1\r\n" * 40000 + b"*40000\r\n", b":1\r\n"), "elements"),
        (endless(b"*40\r\n", b"$524288\r\n" + bytes(524288) + b"\r\n"), "more than 16777216 bytes"),
        (endless(b"$99999999999999\r\n", b"x" * 65536), "longer than Redis allows"),
        (endless(b"", b"*1\r\n"), "nested more than 8 deep"),
        (trickle(b"$100000\r\n"), "timed out|took longer than 0.3 s"),
        (trickle(b"+OK"), "timed out|took longer than 0.3 s"),
    ],
)
def test_a_reply_is_bounded_in_size_and_time_whatever_the_server_sends(
    sock_path: pathlib.Path, feed: Callable[[socket.socket, threading.Event], None], error: str
) -> None:
    """Scenario: a server that answers a line without end, arrays of more elements
    than any reply the tier reads, more bytes of small values than it keeps, a value
    longer than Redis allows, or a reply a byte at a time (each read returns within
    the timeout). Each read ends with a clear error and the connection closed; memory
    held stays bounded."""
    server = Streaming(sock_path, feed)
    c = RespConnection(f"unix://{sock_path}", 0.3)
    got: list[BaseException] = []

    def read() -> None:
        c.send([encode("PING")])
        try:
            c.read()
        except (RespError, OSError) as exc:
            got.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=30)  # a deadline for the test, far above the reply's own 0.3 s
    try:
        assert not t.is_alive(), "the read did not end"
        assert got and re.search(error, str(got[0])), got
        assert c._sock is None  # closed: the next use reconnects
        assert len(c._buf) <= MAX_LINE_BYTES + (1 << 20)
    finally:
        server.close()


def test_check_url_refuses_what_no_connection_could_reach() -> None:
    for good in ("redis://h:6379/2", "rediss://u:p@h", "unix:///run/redis.sock", "redis://h"):
        check_url(good)
    for bad, why in [
        ("http://h:6379", "scheme"),
        ("redis://h:99999", "(?i)port"),
        ("redis://h:6379/db", "database"),
        ("unix://", "path"),
        ("redis://h/0?ssl_cert_reqs=none", "options"),
        ("redis://h/\u00b2", "database"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_url(bad)


def test_send_parts_sends_blocks_in_place_whatever_the_socket_takes(
    sock_path: pathlib.Path,
) -> None:
    """More parts than one sendmsg takes, empty ones, and a block far larger than the
    socket's buffer: the server receives exactly the parts, in order."""
    block = bytearray(range(256)) * (16 << 10)  # 4 MiB
    ids = array.array("q", range(1000))  # a view of 8-byte items goes as its bytes
    parts: list[bytes | memoryview] = [b"%d," % i for i in range(IOV_PARTS + 100)]
    parts[3:3] = [b"", memoryview(block), b"", memoryview(block)[1:7], memoryview(ids)]
    whole = b"".join(bytes(p) for p in parts)
    server = Scripted(sock_path, b"+OK\r\n", len(whole), 1 << 16)
    c = RespConnection(f"unix://{sock_path}", 5.0)
    c.send_parts(parts)
    assert c.read() == b"OK" and server.received == whole
    head = encode_head(b"HSET", "k", 7, last_bytes=3)
    assert head + b"abc\r\n" == encode("HSET", "k", 7, "abc")
    c.close()
    server.close()


def test_a_send_the_server_does_not_take_ends_within_its_bound(sock_path: pathlib.Path) -> None:
    """Scenario: a server that stops reading. The send ends after ``timeout_s`` plus
    its bytes at ``MIN_SEND_BYTES_PER_S``, the connection closed."""
    server = Streaming(sock_path, lambda conn, stop: stop.wait())  # reads 64 KiB, no more
    c = RespConnection(f"unix://{sock_path}", 0.3)
    nbytes = 8 << 20
    got: list[BaseException] = []

    def send() -> None:
        try:
            c.send_parts([b"x" * 65536, memoryview(bytearray(nbytes))])
        except OSError as exc:
            got.append(exc)

    t = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(timeout=30)  # the test's deadline, far above the send's bound
    try:
        assert not t.is_alive(), "the send did not end"
        bound_s = 0.3 + (nbytes + 65536) / MIN_SEND_BYTES_PER_S
        assert got and isinstance(got[0], TimeoutError), got
        assert re.search(r"a send of \d+ bytes took over", str(got[0]))
        assert time.monotonic() - started >= bound_s * 0.9  # not given up early either
        assert c._sock is None
    finally:
        server.close()


def test_a_pipeline_s_replies_share_one_deadline(sock_path: pathlib.Path) -> None:
    """Scenario: each reply of a pipeline comes well within the timeout, but all of
    them together take longer: ``read_replies`` ends at the one deadline."""

    def slow_replies(conn: socket.socket, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            conn.sendall(b":1\r\n")

    server = Streaming(sock_path, slow_replies)
    c = RespConnection(f"unix://{sock_path}", 0.35)
    c.send([encode("PING")] * 20)
    try:
        with pytest.raises(TimeoutError, match=r"took longer than 0\.35 s"):
            c.read_replies(20)
        assert c._sock is None
    finally:
        server.close()


def test_a_connection_the_server_closed_while_idle_is_replaced(sock_path: pathlib.Path) -> None:
    """Scenario: Redis's ``timeout`` closes a tier thread's connection while it waits
    for work. The next command goes on a new connection instead of failing."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(2)
    first_closed = threading.Event()

    def serve() -> None:
        for i in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"+PONG\r\n")
                if i == 1:
                    conn.recv(1)  # until the client goes
            first_closed.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = RespConnection(f"unix://{sock_path}", 5.0)
    try:
        c.send([encode("PING")])
        assert c.read() == b"PONG"
        assert first_closed.wait(10)  # the server closed it; the client has not noticed
        c.begin()  # a tier's next job or poll
        c.send([encode("PING")])
        assert c.read() == b"PONG"
    finally:
        c.close()
        t.join(10)
        listener.close()
