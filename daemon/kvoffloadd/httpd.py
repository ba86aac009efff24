"""A small HTTP/1.0 server for the metrics listener: one thread, bounded in everything.

The metrics port is open to every local uid (and, bound elsewhere, to the network),
so the server must not let anyone take the daemon down: a server with one thread per
connection (prometheus-client's) ran out of threads and descriptors with a thousand
idle TCP connections.

Rules:
- One thread, non-blocking sockets and a selector; at most ``MAX_CONNECTIONS`` open:
  beyond that the newest is closed at once, and at EMFILE a reserve descriptor lets
  it accept and close one.
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
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0

Handler = Callable[[], tuple[int, str, bytes]]  # (status, content type, body)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    deadline_s: float
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytes = b""


class HttpServer:
    def __init__(self, address: str, port: int, routes: dict[str, Handler]) -> None:
        self.routes = routes
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((address, port))
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._reserve = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self._stop = False
        self.shed_total = 0
        self.thread = threading.Thread(target=self._run, name="kvoffload-http", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            now = time.monotonic()
            for key, mask in self._sel.select(1.0):
                if key.fileobj is self.listener:
                    self._accept(now)
                elif key.fileobj is self._wake_r:
                    continue
                else:
                    self._io(self._conns[key.fileobj], mask)  # type: ignore[index]
            for c in [c for c in self._conns.values() if c.deadline_s < now]:
                self._close(c)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = self.listener.accept()
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
            if len(self._conns) >= MAX_CONNECTIONS:
                sock.close()
                self.shed_total += 1
                continue
            sock.setblocking(False)
            conn = _Conn(sock, now + REQUEST_TIMEOUT_S)
            self._conns[sock] = conn
            self._sel.register(sock, selectors.EVENT_READ)

    def _io(self, c: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_READ and not c.outbuf:
                data = c.sock.recv(4096)
                if not data:
                    self._close(c)
                    return
                c.inbuf += data
                if b"\r\n\r\n" in c.inbuf or b"\n\n" in c.inbuf:
                    c.outbuf = self._respond(bytes(c.inbuf))
                    self._sel.modify(c.sock, selectors.EVENT_WRITE)
                elif len(c.inbuf) > MAX_REQUEST_BYTES:
                    self._close(c)
                    return
            if mask & selectors.EVENT_WRITE and c.outbuf:
                n = c.sock.send(c.outbuf)
                c.outbuf = c.outbuf[n:]
                if not c.outbuf:
                    self._close(c)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)

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
