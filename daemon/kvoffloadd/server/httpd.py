"""A small HTTP/1.0 server for the metrics listener: one thread, bounded in everything,
and no peer can keep another's request (a health probe) from being answered.

The metrics port is open to every local uid (and, bound elsewhere, to the network),
so the server must not let anyone take the daemon down: a server with one thread per
connection (prometheus-client's) ran out of threads and descriptors with a thousand
idle TCP connections. Nor may anyone starve the probes the orchestrator restarts the
daemon by: 64 idle connections once answered 0 of 32 probes.

Rules:
- One thread, non-blocking sockets and a selector; at most ``MAX_CONNECTIONS`` open,
  ``MAX_PER_PEER`` per peer address; at EMFILE a reserve descriptor lets it accept and
  close one.
- The kernel hands over a connection only once it has sent something
  (``TCP_DEFER_ACCEPT``, up to ``REQUEST_TIMEOUT_S``), and a request already whole then
  is answered at once, without taking a place: a probe writes its request as soon as
  it connects, so a flood of connections that send nothing never stands in its way.
- A new connection is never refused for room while an older one waits: it replaces
  the oldest connection of its own peer when that peer is at its cap, else, when all
  places are taken, the oldest one of the peer holding the most. Only a connection
  accepted in this very turn of the loop is safe (it has not been read yet): when only
  such ones could make room, the newcomer is closed instead. Idle, slowly written and
  unread connections hold a place only until someone needs it.
- Within a turn, connections are served before new ones are accepted, and at most
  ``MAX_ACCEPTS_PER_TURN`` are accepted: a flood cannot keep the others from being read.
- A request must arrive whole (request line and headers, at most
  ``MAX_REQUEST_BYTES``) within ``REQUEST_TIMEOUT_S``; only ``GET`` of a known path
  is answered; the connection is closed after each response.
- Handlers run on this thread and read only what the loop thread published (a
  reference swap): nothing here touches daemon metadata.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
MAX_PER_PEER = 8
MAX_ACCEPTS_PER_TURN = 64
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
LISTEN_BACKLOG = 1024

Handler = Callable[[], tuple[int, str, bytes]]  # (status, content type, body)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    turn: int  # the loop turn that accepted it
    deadline_s: float
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytes = b""


class HttpServer:
    def __init__(self, address: str, port: int, routes: dict[str, Handler]) -> None:
        self.routes = routes
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accept a connection only once its first bytes are in (or after the request
        # timeout): one that sends nothing costs the kernel a SYN-queue entry, not us
        self.listener.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, int(REQUEST_TIMEOUT_S)
        )
        self.listener.bind((address, port))
        self.listener.listen(LISTEN_BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, _READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, _READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._by_peer: dict[str, list[_Conn]] = {}  # oldest first
        self._reserve = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self._turn = 0
        self._stop = False
        self.shed_total = 0  # connections closed unanswered for want of room
        self.evicted_total = 0  # connections closed to make room for newer ones
        self.thread = threading.Thread(target=self._run, name="kvoffload-http", daemon=True)
        self.thread.start()

    @property
    def open_connections(self) -> int:
        """Connections holding a place now (a length read: safe from any thread)."""
        return len(self._conns)

    def _run(self) -> None:
        while not self._stop:
            events = self._sel.select(1.0)
            self._turn += 1
            now = time.monotonic()
            pending = False
            for key, mask in events:
                if key.fileobj is self.listener:
                    pending = True
                elif key.fileobj is self._wake_r:
                    continue
                else:
                    self._serve(self._conns[key.fileobj], mask)  # type: ignore[index]
            if pending:
                self._accept(now)
            for c in [c for c in self._conns.values() if c.deadline_s < now]:
                self._close(c)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_ACCEPTS_PER_TURN):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    os.close(self._reserve)
                    with contextlib.suppress(OSError):
                        self.listener.accept()[0].close()
                    self._reserve = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
                    self.shed_total += 1
                return
            sock.setblocking(False)
            c = _Conn(sock, str(addr[0]), self._turn, now + REQUEST_TIMEOUT_S)
            if not self._io(c, _READ | _WRITE):
                sock.close()  # answered (or gone) at once: it never needed a place
                continue
            if not self._make_room(c.peer):
                sock.close()
                self.shed_total += 1
                continue
            self._conns[sock] = c
            self._by_peer.setdefault(c.peer, []).append(c)
            self._sel.register(sock, _WRITE if c.outbuf else _READ)

    def _make_room(self, peer: str) -> bool:
        """Close the connection a newcomer from ``peer`` replaces, if it needs one;
        False when only connections not read yet could go."""
        mine = self._by_peer.get(peer, [])
        if len(mine) >= MAX_PER_PEER:
            return self._evict_from(mine)
        if len(self._conns) < MAX_CONNECTIONS:
            return True
        return any(
            self._evict_from(conns)
            for conns in sorted(self._by_peer.values(), key=len, reverse=True)
        )

    def _evict_from(self, conns: list[_Conn]) -> bool:
        for c in conns:
            if c.turn < self._turn:
                self._close(c)
                self.evicted_total += 1
                return True
        return False

    def _serve(self, c: _Conn, mask: int) -> None:
        if self._io(c, mask):
            self._sel.modify(c.sock, _WRITE if c.outbuf else _READ)
        else:
            self._close(c)

    def _io(self, c: _Conn, mask: int) -> bool:
        """Read what has come, answer a whole request, send what the socket takes;
        False once the connection is done with (answered, closed or broken)."""
        try:
            if mask & _READ and not c.outbuf:
                data = c.sock.recv(4096)
                if not data:
                    return False
                c.inbuf += data
                if b"\r\n\r\n" in c.inbuf or b"\n\n" in c.inbuf:
                    c.outbuf = self._respond(bytes(c.inbuf))
                elif len(c.inbuf) > MAX_REQUEST_BYTES:
                    return False
            if c.outbuf:
                n = c.sock.send(c.outbuf)
                c.outbuf = c.outbuf[n:]
                return bool(c.outbuf)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return True

    def _respond(self, request: bytes) -> bytes:
        parts = request.split(b"\r\n", 1)[0].split()
        status, ctype, body = 400, "text/plain", b"bad request\n"
        if len(parts) >= 2 and parts[0] == b"GET":
            handler = self.routes.get(parts[1].split(b"?", 1)[0].decode(errors="replace"))
            if handler is None:
                status, body = 404, b"not found\n"
            else:
                try:
                    status, ctype, body = handler()
                except Exception as exc:  # a handler bug must not end the thread
                    log.exception("metrics handler failed")
                    status, body = 503, f"error: {exc}\n".encode()
        head = (
            f"HTTP/1.0 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode() + body

    def _close(self, c: _Conn) -> None:
        if self._conns.pop(c.sock, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
            peers = self._by_peer[c.peer]
            peers.remove(c)
            if not peers:
                del self._by_peer[c.peer]
        c.sock.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self.thread.join(10)
        for c in list(self._conns.values()):
            self._close(c)
        self._sel.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()
        os.close(self._reserve)
