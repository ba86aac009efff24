"""Blocking unix-socket transport under the sans-IO ``ClientConnection``.

Rules:
- Every call has a deadline; a timeout or any OS error closes the socket and raises
  ``DaemonUnavailableError``: after a lost reply the stream cannot be trusted.
- ``ErrorReply`` becomes the typed exception for its code.
- Replies to fire-and-forget requests (``send_nowait``) are read and dropped while
  waiting for a later reply.
- File descriptors go out with SCM_RIGHTS in the same ``sendmsg`` as the frame that
  refers to them.
"""

from __future__ import annotations

import array
import logging
import socket
import time

from .protocol import NEED_DATA, ClientConnection
from .protocol import messages as m
from .protocol.errors import (
    DaemonUnavailableError,
    ProtocolError,
    error_for_code,
)

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024


class Transport:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.conn = ClientConnection()
        self._nowait: set[int] = set()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailableError(f"cannot connect to kvoffloadd at {path}: {exc}") from exc
        self.sock: socket.socket | None = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.conn.close()

    def _send(self, req: m.Request, fds: list[int] | None) -> None:
        if self.sock is None:
            raise DaemonUnavailableError("connection to kvoffloadd is closed")
        frame = self.conn.send(req)
        try:
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self.sock.sendmsg([frame], anc)
                if sent < len(frame):
                    self.sock.sendall(frame[sent:])
            else:
                self.sock.sendall(frame)
        except OSError as exc:
            self.close()
            raise DaemonUnavailableError(f"lost kvoffloadd at {self.path}: {exc}") from exc

    def send_nowait(self, req: m.Request) -> None:
        self._send(req, None)
        self._nowait.add(req.rid)

    def request(
        self, req: m.Request, fds: list[int] | None = None, timeout_s: float | None = None
    ) -> m.Reply:
        self._send(req, fds)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            reply = self._next_reply(deadline)
            if reply.rid in self._nowait:
                self._nowait.discard(reply.rid)
                if isinstance(reply, m.ErrorReply):
                    log.debug("fire-and-forget request failed: %s", reply.message)
                continue
            if reply.rid != req.rid:
                self.close()
                raise DaemonUnavailableError(f"reply for request {reply.rid}, expected {req.rid}")
            if isinstance(reply, m.ErrorReply):
                raise error_for_code(reply.code, reply.message)
            return reply

    def _next_reply(self, deadline: float) -> m.Reply:
        try:
            while True:
                event = self.conn.next_event()
                if event is not NEED_DATA:
                    assert not isinstance(event, type(NEED_DATA))
                    return event
                if self.sock is None:
                    raise DaemonUnavailableError("connection to kvoffloadd is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
                data = self.sock.recv(RECV_BYTES)
                if not data:
                    raise ConnectionResetError("kvoffloadd closed the connection")
                self.conn.receive_data(data)
        except ProtocolError as exc:
            self.close()
            raise DaemonUnavailableError(f"protocol error talking to kvoffloadd: {exc}") from exc
        except (OSError, TimeoutError) as exc:
            self.close()
            what = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise DaemonUnavailableError(f"kvoffloadd at {self.path}: {what}") from exc
