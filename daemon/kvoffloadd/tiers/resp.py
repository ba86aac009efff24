"""A minimal RESP2 connection that receives bulk replies straight into caller memory.

A general client turns every reply into a Python ``bytes`` that the tier would then
copy into the region slot, and joins every command into one string before it sends it;
for blocks of megabytes those copies are the whole cost. This connection sends
pipelined commands whose block arguments are the slots themselves (``sendmsg``), and
reads each reply with ``recv_into``: a bulk string bound for a slot goes from the
socket into the slot, no copy in between.

Rules:
- One connection per tier thread, never shared; connect, AUTH and SELECT as the
  tier's URL says (redis://, rediss:// with the system's CA roots, unix://; checked by
  ``check_url`` before any connection). A connection the server closed while it sat
  idle (Redis's ``timeout``) is found when an exchange begins (``begin``), and replaced.
- A send is bounded too: ``send_parts`` must be done within ``timeout_s`` plus its
  bytes at ``MIN_SEND_BYTES_PER_S``, however slowly the server takes them.
- ``read_into(view)`` accepts a bulk reply only if it is exactly ``len(view)`` bytes
  long; any other length (a foreign value) is read and dropped, and answers ``False``.
  Other replies larger than ``MAX_BUFFERED_BYTES`` (or the caller's smaller
  ``max_bulk_bytes``: index members) are dropped too (a RespError in their place):
  what another Redis user writes at a block's key never takes the daemon's memory.
- A reply is bounded whatever the server sends: it must arrive within the
  connection's ``timeout_s`` (each read waits at most what is left of it, so a
  trickle ends there too), a line (a header, a simple string, an error) is at most
  ``MAX_LINE_BYTES``, one reply holds at most ``MAX_REPLY_ELEMENTS`` array elements
  nested at most ``MAX_DEPTH`` deep and ``MAX_REPLY_BYTES`` of bulk strings, and a
  value declared longer than Redis allows (``MAX_SKIP_BYTES``) is not read at all.
  Past any of them the connection closes (``RespError`` or ``TimeoutError``).
- A protocol error or a socket error closes the connection (``RespError`` or
  ``OSError``); the next use reconnects.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

MAX_BUFFERED_BYTES = 1 << 20  # larger replies are dropped unread, unless read into a view
MAX_LINE_BYTES = 64 << 10  # a header, a simple string or an error line
MAX_REPLY_ELEMENTS = 1 << 16  # array elements in one reply, nested ones included
MAX_REPLY_BYTES = 16 << 20  # bulk-string bytes one reply keeps
MAX_SKIP_BYTES = 512 << 20  # Redis's proto-max-bulk-len: no real value is longer
MAX_DEPTH = 8  # arrays within arrays (the tier's replies nest two deep at most)
MIN_SEND_BYTES_PER_S = 4 << 20  # a send may take timeout_s plus its bytes at this rate
IOV_PARTS = 512  # buffers per sendmsg (IOV_MAX is 1024 on Linux)
SCHEMES = ("redis", "rediss", "unix")


class RespError(Exception):
    """The server answered an error, or something that is not RESP."""


def _encoded(args: Sequence[bytes | str | int], count: int) -> list[bytes]:
    parts = [b"*%d\r\n" % count]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return parts


def encode(*args: bytes | str | int) -> bytes:
    """One command in RESP (small arguments only: keys, numbers, script names)."""
    return b"".join(_encoded(args, len(args)))


def encode_head(*args: bytes | str | int, last_bytes: int) -> bytes:
    """A command whose last argument, ``last_bytes`` long, is not included: the caller
    sends that argument (a block) right after, then ``b"\r\n"``."""
    return b"".join(_encoded(args, len(args) + 1)) + b"$%d\r\n" % last_bytes


def check_url(url: str) -> None:
    """ValueError unless ``url`` names a server this connection can reach."""
    u = urlparse(url)
    if u.scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(SCHEMES)}")
    if u.query or u.fragment or u.params:
        raise ValueError("options after the path (?...) are not supported")
    if u.scheme == "unix":
        if not u.path:
            raise ValueError("a unix:// url needs the socket's path")
        return
    _ = u.port  # ValueError for a port that is not a number in range
    db = u.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"the database must be a number, not {db!r}")


class RespConnection:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes received past the last reply read
        self._scanned = 0  # bytes of _buf known to hold no CRLF
        self._deadline_s = 0.0  # the reply being read must be in by then
        self._elements_left = self._bytes_left = 0  # of the reply being read

    def _open(self) -> socket.socket:
        """A connected socket (TLS set up for rediss://); closed again if that fails."""
        u = urlparse(self.url)
        if u.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            sock = socket.create_connection(
                (u.hostname or "127.0.0.1", u.port or 6379), self.timeout_s
            )
        try:
            sock.settimeout(self.timeout_s)
            if u.scheme == "unix":
                sock.connect(u.path)
                return sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if u.scheme == "rediss":
                return ssl.create_default_context().wrap_socket(sock, server_hostname=u.hostname)
            return sock
        except BaseException:
            sock.close()
            raise

    def _connect(self) -> socket.socket:
        u = urlparse(self.url)
        sock = self._open()
        sock.settimeout(self.timeout_s)
        self._sock, self._buf, self._scanned = sock, bytearray(), 0
        hello: list[bytes] = []
        if u.password:
            user = unquote(u.username or "")
            auth = (user, unquote(u.password)) if user else (unquote(u.password),)
            hello.append(encode("AUTH", *auth))
        db = u.path.strip("/") if u.scheme != "unix" else ""
        if db and db != "0":
            hello.append(encode("SELECT", db))
        if hello:
            self.send(hello)
            for _ in hello:
                if isinstance(reply := self.read(), RespError):
                    self.close()
                    raise reply
        return sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def send(self, commands: Sequence[bytes]) -> None:
        """Small commands (``encode``), joined and sent at once."""
        self.send_parts([b"".join(commands)])

    def begin(self) -> None:
        """Start an exchange (a job's, a poll's): with no reply outstanding nothing may
        arrive, so a connection with something to read (the end of the stream: the
        server closed it while it sat idle) is closed, and the next send reconnects."""
        if self._sock is None:
            return
        poller = select.poll()  # not select(): the daemon's descriptors pass 1024
        poller.register(self._sock, select.POLLIN)
        pending = isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
        if self._buf or pending or poller.poll(0):
            self.close()

    def send_parts(self, parts: Sequence[bytes | memoryview]) -> None:
        """Commands laid out in ``parts``, sent as they are: a block argument is its
        slot's memory, never copied. Done within ``timeout_s`` plus the bytes at
        ``MIN_SEND_BYTES_PER_S``, or the connection closes (``TimeoutError``)."""
        sock = self._sock or self._connect()
        views = [v for p in parts if (v := memoryview(p).cast("B"))]
        total = sum(len(v) for v in views)
        bound_s = self.timeout_s + total / MIN_SEND_BYTES_PER_S
        deadline_s = time.monotonic() + bound_s
        plain = not isinstance(sock, ssl.SSLSocket)  # TLS has no sendmsg
        i = 0
        try:
            while i < len(views):
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError
                sock.settimeout(left_s)
                sent = sock.sendmsg(views[i : i + IOV_PARTS]) if plain else sock.send(views[i])
                while sent and i < len(views):
                    if sent >= len(views[i]):
                        sent -= len(views[i])
                        i += 1
                    else:
                        views[i] = views[i][sent:]
                        sent = 0
        except OSError as exc:
            self.close()
            if isinstance(exc, TimeoutError):  # the socket's or the deadline's
                raise TimeoutError(f"a send of {total} bytes took over {bound_s:.3g} s") from exc
            raise

    # ------------------------------------------------------------ reading

    def _wait_s(self) -> None:
        """Let the next read wait at most what is left of the reply's time."""
        left_s = self._deadline_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError(f"a reply took longer than {self.timeout_s:g} s")
        assert self._sock is not None
        self._sock.settimeout(left_s)

    def _fill(self, at_least: int) -> None:
        assert self._sock is not None
        while len(self._buf) < at_least:
            self._wait_s()
            chunk = self._sock.recv(max(65536, at_least - len(self._buf)))
            if not chunk:
                raise OSError("the server closed the connection")
            self._buf += chunk

    def _skip(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a reply nobody wants), a bounded chunk at a time."""
        drop = min(nbytes, len(self._buf))
        del self._buf[:drop]
        nbytes -= drop
        assert self._sock is not None
        while nbytes > 0:
            self._wait_s()
            chunk = self._sock.recv(min(nbytes, 1 << 20))
            if not chunk:
                raise OSError("the server closed the connection")
            nbytes -= len(chunk)

    def _skip_value(self, n: int) -> None:
        """Drop a bulk string of ``n`` bytes nobody wants (and its CRLF)."""
        if n > MAX_SKIP_BYTES:
            raise ValueError(f"a {n}-byte value, longer than Redis allows")
        self._skip(n + 2)

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n", max(0, self._scanned - 1))) < 0:
            self._scanned = len(self._buf)
            if self._scanned > MAX_LINE_BYTES:
                raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
            self._fill(len(self._buf) + 1)
        self._scanned = 0
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def _guard(self, fn: Any, *args: Any, deadline_s: float = 0.0) -> Any:
        if self._sock is None:
            raise OSError("not connected")
        self._deadline_s = deadline_s or time.monotonic() + self.timeout_s
        self._elements_left, self._bytes_left = MAX_REPLY_ELEMENTS, MAX_REPLY_BYTES
        try:
            return fn(*args)
        except (OSError, RespError, ValueError) as exc:
            self.close()
            if isinstance(exc, TimeoutError):  # the socket's or the deadline's
                raise TimeoutError(f"a reply took longer than {self.timeout_s:g} s") from exc
            if isinstance(exc, ValueError):
                raise RespError(f"not a RESP reply: {exc}") from exc
            raise

    def read(self, max_bulk_bytes: int = MAX_BUFFERED_BYTES) -> Any:
        """One reply: int, bytes, None, a list, or ``RespError`` for an error reply;
        a bulk string over ``max_bulk_bytes`` (also inside arrays) is a ``RespError``."""
        return self._guard(self._read, min(max_bulk_bytes, MAX_BUFFERED_BYTES))

    def read_replies(self, count: int, max_bulk_bytes: int = MAX_BUFFERED_BYTES) -> list[Any]:
        """A pipeline's ``count`` replies (each as ``read`` gives it), all of them
        within one ``timeout_s``."""
        deadline_s = time.monotonic() + self.timeout_s
        limit = min(max_bulk_bytes, MAX_BUFFERED_BYTES)
        return [self._guard(self._read, limit, deadline_s=deadline_s) for _ in range(count)]

    def _read(self, max_bulk_bytes: int = MAX_BUFFERED_BYTES, depth: int = 0) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if n > max_bulk_bytes:  # a foreign value: never held in memory
                self._skip_value(n)
                return RespError(f"a {n}-byte value where a small one belongs")
            self._bytes_left -= n
            if self._bytes_left < 0:
                raise ValueError(f"a reply of more than {MAX_REPLY_BYTES} bytes")
            self._fill(n + 2)
            data = bytes(self._buf[:n])
            del self._buf[: n + 2]
            return data
        if kind == b"*":
            n = int(rest)
            self._elements_left -= max(0, n)
            if self._elements_left < 0:
                raise ValueError(f"a reply of more than {MAX_REPLY_ELEMENTS} elements")
            if depth >= MAX_DEPTH:
                raise ValueError(f"arrays nested more than {MAX_DEPTH} deep")
            return None if n < 0 else [self._read(max_bulk_bytes, depth + 1) for _ in range(n)]
        raise ValueError(f"unexpected reply {line[:40]!r}")

    def read_array_header(self) -> int | RespError:
        """The length of an array reply (-1: nil), or the error the server answered
        instead (a key of the wrong type: that command failed, the connection is fine)."""
        line = self._guard(self._line)
        if line[:1] == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"*":
            self.close()
            raise RespError(f"expected an array, got {line[:40]!r}")
        return int(line[1:])

    def read_into(self, view: memoryview) -> bool | None:
        """A bulk reply into ``view``: True if it was exactly ``view``'s length, None
        for a nil reply, False for any other length (dropped)."""
        got: bool | None = self._guard(self._read_into, view)
        return got

    def _read_into(self, view: memoryview) -> bool | None:
        line = self._line()
        if line[:1] != b"$":
            raise ValueError(f"expected a bulk string, got {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        if n != len(view):
            self._skip_value(n)
            return False
        have = min(len(self._buf), n)  # what arrived with the header
        view[:have] = self._buf[:have]
        del self._buf[:have]
        assert self._sock is not None
        pos = have
        while pos < n:
            self._wait_s()
            got = self._sock.recv_into(view[pos:], n - pos)
            if not got:
                raise OSError("the server closed the connection")
            pos += got
        self._fill(2)
        if self._buf[:2] != b"\r\n":
            raise ValueError("a bulk string without its CRLF")
        del self._buf[:2]
        return True
