"""Unix-socket transport under the sans-IO ``ClientConnection``.

Rules:
- Blocking requests (``request``) have a deadline; a timeout or any OS error closes
  the socket and raises ``DaemonUnavailableError``: after a lost reply the stream
  cannot be trusted. The socket is blocking with kernel receive/send timeouts
  (SO_RCVTIMEO/SO_SNDTIMEO), so a round trip costs one send and one recv system call,
  with no poll in between; a call therefore gives up after at most ``2 * timeout_s``.
- One-way requests (``post``) are queued and written by ``flush`` without blocking
  (MSG_DONTWAIT); what the kernel does not take now stays queued, in order, and goes
  before anything sent later. A daemon that stops reading for good fills the queue
  past ``MAX_OUTBOX_BYTES``: the connection is then given up as lost.
- ``poll`` reads whatever has arrived without blocking (or waits up to ``timeout_s``
  for something) and returns the pushes; an end of stream is a lost daemon.
- ``ErrorReply`` becomes the typed exception for its code.
- Replies to fire-and-forget requests (``send_nowait``) are read and dropped; pushes
  that arrive while a blocking request waits are kept for the next ``poll``. At most
  ``MAX_UNANSWERED`` of them are out at once: past that, ``send_nowait`` reads replies
  until half are in, so no request ever waits behind more than that much of its own
  connection's queued work (and a caller that never polls holds no growing set).
- File descriptors go out with SCM_RIGHTS in the same ``sendmsg`` as the frame that
  refers to them; descriptors a reply brings (the region, for trusted workers) wait in
  ``received_fds`` for whoever asked for them. Only the replies to ``BRINGS_FDS``
  requests bring any: the others are read with a plain ``recv_into``, no room for
  descriptors (the kernel closes any that come anyway).
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import struct
import time

from kvoffload.link.peer import check_daemon
from kvoffload.protocol import ClientConnection, NeedData
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import (
    DaemonUnavailableError,
    KVOffloadError,
    ProtocolError,
    error_for_code,
)

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
MAX_OUTBOX_BYTES = 16 * 1024 * 1024
MAX_UNANSWERED = 64  # fire-and-forget requests sent and not yet answered
_ANC_BYTES = socket.CMSG_SPACE(4 * 4)  # room for a few descriptors (one is expected)


class Transport:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.conn = ClientConnection()
        self._nowait: set[int] = set()
        self.received_fds: list[int] = []  # SCM_RIGHTS descriptors replies brought
        self.pushed: list[m.Reply] = []  # pushes not yet taken by ``poll``
        self.lost_noted = False  # its loss was counted and logged (client.py)
        self._outbox = bytearray()
        # One receive buffer for the connection's life: a fresh 256 KiB bytes object
        # per recvmsg is an mmap and munmap each, more than the rest of a ping.
        self._rbuf = bytearray(RECV_BYTES)
        self._rbufs = [self._rbuf]
        self._rview = memoryview(self._rbuf)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailableError(f"cannot connect to kvoffloadd at {path}: {exc}") from exc
        try:
            check_daemon(sock, path)  # nothing of ours goes to a planted socket
        except BaseException:
            sock.close()
            raise
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

    def take_pushed(self) -> list[m.Reply]:
        """Pushes that arrived during blocking requests, without reading the socket."""
        out, self.pushed = self.pushed, []
        return out

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

    def _lost(self, exc: BaseException | str) -> DaemonUnavailableError:
        self.close()
        return DaemonUnavailableError(f"lost kvoffloadd at {self.path}: {exc}")

    # ------------------------------------------------------------ one-way

    def post(self, req: m.Request) -> None:
        """Queue a one-way request (rid 0); ``flush`` writes it."""
        outbox = self._outbox
        queued = len(outbox)
        try:
            self.conn.send_into(req, outbox)  # encoded in place: no copies
        except ProtocolError as exc:
            raise self._lost(exc) from exc
        except BaseException:
            del outbox[queued:]  # an unencodable request leaves no partial frame
            raise

    @property
    def unsent_bytes(self) -> int:
        return len(self._outbox)

    def flush(self) -> None:
        """Write queued one-way frames without blocking; raises when the daemon is gone
        or has stopped reading for good."""
        sock = self.sock
        if sock is None:
            raise DaemonUnavailableError("connection to kvoffloadd is closed")
        while self._outbox:
            try:
                n = sock.send(self._outbox, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise self._lost(exc) from exc
            del self._outbox[:n]
        if len(self._outbox) > MAX_OUTBOX_BYTES:
            raise self._lost(f"it has not read {len(self._outbox)} bytes of requests")

    def poll(self, timeout_s: float = 0.0) -> list[m.Reply]:
        """Pushes that arrived (waiting up to ``timeout_s`` for the first bytes)."""
        sock = self.sock
        if sock is None:
            raise DaemonUnavailableError("connection to kvoffloadd is closed")
        if timeout_s > 0 and not self.pushed:
            self._decode_buffered()  # what an earlier read brought along goes first
        if timeout_s > 0 and not self.pushed:
            try:
                ready, _, _ = select.select([sock], [], [], timeout_s)
            except (OSError, ValueError) as exc:
                raise self._lost(exc) from exc
            if not ready:
                return []
        try:
            while True:
                try:
                    n, anc, _, _ = sock.recvmsg_into([self._rbuf], _ANC_BYTES, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                if not n:
                    raise ConnectionResetError("kvoffloadd closed the connection")
                self._take_anc(anc)
                self.conn.receive_data(self._rview[:n])
                if n < RECV_BYTES:
                    break
            while not isinstance(event := self.conn.next_event(), NeedData):
                self._route(event)
        except (OSError, ProtocolError) as exc:
            raise self._lost(exc) from exc
        out, self.pushed = self.pushed, []
        return out

    def _route(self, event: m.Reply) -> None:
        """A message outside a blocking request: a push, or a dropped nowait reply."""
        if event.rid == 0:
            self.pushed.append(event)
        elif event.rid in self._nowait:
            self._nowait.discard(event.rid)
            if isinstance(event, m.ErrorReply):
                log.debug("fire-and-forget request failed: %s", event.message)
        else:
            raise ProtocolError(f"unexpected reply to request {event.rid}")

    # ------------------------------------------------------------ blocking

    def _send(self, req: m.Request, fds: list[int] | None) -> None:
        sock = self.sock
        if sock is None:
            raise DaemonUnavailableError("connection to kvoffloadd is closed")
        frame = bytearray()
        self.conn.send_into(req, frame)
        try:
            if self._outbox:  # one-way frames queued earlier go first
                sock.sendall(self._outbox)
                self._outbox.clear()
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = sock.sendmsg([frame], anc)
                if sent < len(frame):
                    sock.sendall(memoryview(frame)[sent:])
            else:
                sock.sendall(frame)
        except OSError as exc:
            self._last_word()
            raise self._lost(exc) from exc

    def _last_word(self) -> None:
        """A send failed: if the daemon said why before closing (a refusal), raise that."""
        if self.sock is None:
            return
        try:
            data = self.sock.recv(RECV_BYTES, socket.MSG_DONTWAIT)
            self.conn.receive_data(data)
            while not isinstance(event := self.conn.next_event(), NeedData):
                self._route(event)
        except KVOffloadError as exc:
            if not isinstance(exc, ProtocolError):
                self.close()
                raise
        except OSError:
            pass

    def send_nowait(self, req: m.Request) -> None:
        self._send(req, None)
        self._nowait.add(req.rid)
        if len(self._nowait) > MAX_UNANSWERED:
            self._settle(MAX_UNANSWERED // 2)

    @property
    def unanswered(self) -> int:
        """Fire-and-forget requests sent whose replies have not been read."""
        return len(self._nowait)

    def _settle(self, most: int) -> None:
        """Read replies until at most ``most`` fire-and-forget requests are unanswered,
        then decode whatever else came along (pushes wait for ``poll``). Gives up, the
        daemon lost, after ``2 * timeout_s`` at most (the clock is read before each
        reply; a read waits ``timeout_s`` at most)."""
        self._set_kernel_timeout(self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while len(self._nowait) > most:
            if not self.conn.buffered_bytes and time.monotonic() > deadline:
                raise self._lost(f"{len(self._nowait)} replies did not come in time")
            try:
                self._route(self._next_reply(deadline))
            except ProtocolError as exc:
                raise self._lost(exc) from exc
        self._decode_buffered()

    def _decode_buffered(self) -> None:
        """Route every whole message already received (replies dropped, pushes kept)."""
        try:
            while self.conn.buffered_bytes and not isinstance(
                event := self.conn.next_event(), NeedData
            ):
                self._route(event)
        except ProtocolError as exc:
            raise self._lost(exc) from exc

    def request(
        self, req: m.Request, fds: list[int] | None = None, timeout_s: float | None = None
    ) -> m.Reply:
        limit_s = timeout_s or self.timeout_s
        if limit_s != self._kernel_timeout_s:
            self._set_kernel_timeout(limit_s)
        deadline = time.monotonic() + limit_s
        sock = self.sock
        if sock is None or fds or self._outbox:
            self._send(req, fds)
        else:  # _send, written out: once per request
            frame = bytearray()
            self.conn.send_into(req, frame)
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._last_word()
                raise self._lost(exc) from exc
        rid, brings_fds = req.rid, isinstance(req, m.BRINGS_FDS)
        while True:
            reply = self._next_reply(deadline, brings_fds)
            if reply.rid != rid:
                try:
                    self._route(reply)
                except ProtocolError as exc:
                    raise self._lost(exc) from exc
                continue
            if type(reply) is m.ErrorReply:
                raise error_for_code(reply.code, reply.message)
            return reply

    def _take_anc(self, anc: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self.received_fds.extend(fds)

    def _next_reply(self, deadline: float, brings_fds: bool = False) -> m.Reply:
        """The next message of a blocking request: one already buffered, else read
        (the first read without looking at the clock: the deadline is fresh). With
        ``brings_fds``, reads keep what descriptors come along."""
        conn, rview = self.conn, self._rview
        first = True
        try:
            while True:
                if conn.buffered_bytes:
                    event = conn.next_event()
                    if not isinstance(event, NeedData):
                        return event
                sock = self.sock
                if sock is None:
                    raise DaemonUnavailableError("connection to kvoffloadd is closed")
                if first:
                    first = False
                elif time.monotonic() > deadline:
                    raise TimeoutError
                try:
                    if brings_fds:
                        n, anc, _, _ = sock.recvmsg_into(self._rbufs, _ANC_BYTES)
                        if anc:
                            self._take_anc(anc)
                    else:
                        n = sock.recv_into(self._rbuf)
                except BlockingIOError:  # SO_RCVTIMEO expired
                    raise TimeoutError from None
                if not n:
                    raise ConnectionResetError("kvoffloadd closed the connection")
                # one whole frame and nothing before it: decoded where it lies
                reply = conn.reply_in(rview, n)
                if reply is not None:
                    return reply
                conn.receive_data(rview[:n])
        except ProtocolError as exc:
            self.close()
            raise DaemonUnavailableError(f"protocol error talking to kvoffloadd: {exc}") from exc
        except KVOffloadError:  # the daemon's last word before closing (a refusal)
            self.close()
            raise
        except (OSError, TimeoutError) as exc:
            self.close()
            what = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise DaemonUnavailableError(f"kvoffloadd at {self.path}: {what}") from exc
