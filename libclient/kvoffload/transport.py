"""Blocking unix-socket transport under the sans-IO ``ClientConnection``.

Rules:
- Every call has a deadline; a timeout or any OS error closes the socket and raises
  ``DaemonUnavailableError``: after a lost reply the stream cannot be trusted. The
  socket is blocking with kernel receive/send timeouts (SO_RCVTIMEO/SO_SNDTIMEO), so a
  round trip costs one send and one recv system call, with no poll in between; a
  call therefore gives up after at most ``2 * timeout_s``.
- ``ErrorReply`` becomes the typed exception for its code.
- Replies to fire-and-forget requests (``send_nowait``) are read and dropped while
  waiting for a later reply.
- File descriptors go out with SCM_RIGHTS in the same ``sendmsg`` as the frame that
  refers to them; descriptors a reply brings (the region, for client-copy workers)
  wait in ``received_fds`` for whoever asked for them.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import time

from .protocol import ClientConnection, NeedData
from .protocol import messages as m
from .protocol.errors import (
    DaemonUnavailableError,
    ProtocolError,
    error_for_code,
)

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
_ANC_BYTES = socket.CMSG_SPACE(4 * 4)  # room for a few descriptors (one is expected)


class Transport:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.conn = ClientConnection()
        self._nowait: set[int] = set()
        self.received_fds: list[int] = []  # SCM_RIGHTS descriptors replies brought
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailableError(f"cannot connect to kvoffloadd at {path}: {exc}") from exc
        sock.settimeout(None)
        self._kernel_timeout_s = 0.0
        self.sock: socket.socket | None = sock
        self._set_kernel_timeout(timeout_s)

    def _set_kernel_timeout(self, timeout_s: float) -> None:
        if self.sock is None or timeout_s == self._kernel_timeout_s:
            return
        sec = int(timeout_s)
        tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._kernel_timeout_s = timeout_s

    def take_fds(self) -> list[int]:
        fds, self.received_fds = self.received_fds, []
        return fds

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
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
        limit_s = timeout_s or self.timeout_s
        self._set_kernel_timeout(limit_s)
        self._send(req, fds)
        deadline = time.monotonic() + limit_s
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
                if not isinstance(event, NeedData):
                    return event
                if self.sock is None:
                    raise DaemonUnavailableError("connection to kvoffloadd is closed")
                if time.monotonic() > deadline:
                    raise TimeoutError
                try:
                    data, anc, _, _ = self.sock.recvmsg(RECV_BYTES, _ANC_BYTES)
                except BlockingIOError:  # SO_RCVTIMEO expired
                    raise TimeoutError from None
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                        self.received_fds.extend(fds)
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
