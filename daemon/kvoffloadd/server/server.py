"""The event loop: sockets, file descriptors, signals, timers. Owns no metadata rules.

One thread runs everything that touches metadata: it accepts clients, reads frames
(``recvmsg``, so SCM_RIGHTS descriptors arrive with them), feeds each client's
sans-IO ``ServerConnection``, hands requests to the ``Service`` and writes replies.
Copier threads wake it through an eventfd; signals through ``signal.set_wakeup_fd``.

Rules:
- A protocol error (bad frame, oversized frame, unknown tag, request before Hello)
  gets one ``ErrorReply(rid=0, PROTOCOL_ERROR)`` and that connection is closed;
  everyone else is unaffected (invariant 6).
- Budgets (budgets.py): descriptors (a reserve for shedding at EMFILE, a cap on
  clients and on descriptors parked with SCM_RIGHTS), buffered bytes per connection
  and in total (the largest holder is cut off), and loop time: at most
  ``FRAMES_PER_TURN`` requests or a fair share of ``TURN_S`` per connection per turn,
  none while it has more than ``PAUSE_OUTPUT_BYTES`` of replies unsent (it is not read
  until it reads).
- A peer the access rules refuse gets one ``ErrorReply(rid=0, PERMISSION_DENIED)`` and
  is disconnected at once: it holds no slot and parks nothing.
- One-way requests (rid 0) get no reply; a refused one becomes a push. Pushes the
  service queued (``Session.pushes``) go out after each read and each drain of copy
  completions; pushed event feeds once per loop turn, for connections that keep up.
- An ``AssertionError`` is a broken internal invariant: log the stats, exit non-zero.
- SIGTERM/SIGINT: stop accepting, drain in-flight copies, close, unlink, exit 0.
- The cron (every second, or every half watchdog interval when shorter) runs the
  service's housekeeping, publishes a stats snapshot to the metrics endpoint, and
  tells systemd about progress (STATUS=) and liveness (WATCHDOG=1).
"""

from __future__ import annotations

import array
import contextlib
import errno
import logging
import os
import selectors
import signal
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field

from kvoffload.protocol import NeedData, ServerConnection, encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode, KVOffloadError, ProtocolError
from kvoffloadd.copies.workers import close_fds
from kvoffloadd.server.metrics import MetricsEndpoint
from kvoffloadd.server.systemd import Notifier, watchdog_interval_s
from kvoffloadd.service.budgets import (
    FRAMES_PER_TURN,
    MAX_OUTPUT_BYTES_PER_CLIENT,
    PAUSE_OUTPUT_BYTES,
    Budgets,
    slice_s,
)
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session
from kvoffloadd.service.stats import render_stats
from kvoffloadd.trust import UntrustedError, raise_fd_limit, secure_dir, socket_in_use

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
MAX_FDS_PER_MSG = 253
CRON_PERIOD_S = 1.0
DRAIN_TIMEOUT_S = 30.0
LINGER_S = 5.0  # how long a client closed for a protocol error has to read its replies
_ANC_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MSG * array.array("i").itemsize)


@dataclass(eq=False)  # one per connection, kept in sets by identity
class _Client:
    sock: socket.socket
    conn: ServerConnection
    session: Session
    outbuf: bytearray = field(default_factory=bytearray)
    sent_bytes: int = 0  # everything ever sent, to place descriptors in the stream
    # (stream position, fds): descriptors that go out with the byte at that position
    fd_marks: deque[tuple[int, list[int]]] = field(default_factory=deque)
    events: int = selectors.EVENT_READ  # what the selector watches for it now
    closing_by_s: float = 0.0  # after a protocol error: deliver the replies, then close
    # what this connection holds of the global budgets (budgets.py)
    held_in: int = 0
    held_out: int = 0
    held_fds: int = 0

    @property
    def held_bytes(self) -> int:
        return self.held_in + self.held_out


class Server:
    def __init__(
        self,
        service: Service,
        listener: socket.socket,
        notifier: Notifier | None = None,
        metrics: MetricsEndpoint | None = None,
    ) -> None:
        self.service = service
        self.listener = listener
        self.notifier = notifier or Notifier("")
        self.metrics = metrics
        self._watchdog_s = watchdog_interval_s() if self.notifier.enabled else None
        self._cron_period_s = min(CRON_PERIOD_S, self._watchdog_s or CRON_PERIOD_S)
        self._status = ""
        listener.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, self._accept)
        self.sel.register(service.copier.wake_fd, selectors.EVENT_READ, self._copies_done)
        if service.tiering is not None:
            tiering = service.tiering
            self.sel.register(
                tiering.wake.fd, selectors.EVENT_READ, lambda f, mk: tiering.on_wake()
            )
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self.sel.register(self._sig_r, selectors.EVENT_READ, self._signalled)
        self.clients: dict[int, _Client] = {}
        self._backlog: set[_Client] = set()  # frames left undispatched by a turn's limit
        self._slice_s = slice_s(1)  # one connection's share of this turn
        cfg = service.config
        self.budgets = Budgets(cfg.max_clients, cfg.buffer_budget_bytes, raise_fd_limit())
        service.budgets = self.budgets
        self._next_id = 1
        self._stop = False
        self._max_frame = service.config.max_frame_bytes
        if metrics is not None:  # every series and the probes from the first scrape on
            metrics.publish(render_stats(service), self._cron_period_s)
        # One preallocated receive buffer: allocating a fresh 256 KiB bytes object per
        # recvmsg costs more than the rest of a ping (research/stack.md section 4).
        self._rbuf = bytearray(RECV_BYTES)
        self._rview = memoryview(self._rbuf)

    # ------------------------------------------------------------ main loop

    def catch_signals(self) -> None:
        """Turn SIGTERM/SIGINT into a graceful stop; call before announcing readiness,
        or a stop request that comes right after start-up kills the daemon outright."""
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)

    def serve_forever(self) -> None:
        self.catch_signals()
        next_cron = time.monotonic() + self._cron_period_s
        try:
            while not self._stop:
                timeout = 0.0 if self._backlog else max(0.0, next_cron - time.monotonic())
                ready = self.sel.select(timeout)
                t0 = time.perf_counter()
                self._slice_s = slice_s(len(ready) + len(self._backlog))
                for key, mask in ready:
                    key.data(key.fileobj, mask)
                for c in list(self._backlog):
                    self._process(c)
                self._push_feeds()
                if ready or self._backlog:
                    self.service.loop.record(time.perf_counter() - t0)
                if time.monotonic() >= next_cron:
                    self._cron()
                    next_cron = time.monotonic() + self._cron_period_s
            self.notifier.notify(STOPPING=1, STATUS="draining in-flight copies")
            self._drain()
        except AssertionError:
            log.critical("internal invariant broken; stats: %s", render_stats(self.service))
            raise
        finally:
            signal.set_wakeup_fd(-1)
            for c in list(self.clients.values()):
                self._drop(c, "daemon stopping")
            self.sel.close()
            self.budgets.close()
            self._sig_r.close()
            self._sig_w.close()

    def _cron(self) -> None:
        self.service.cron()
        self.budgets.trim()
        now = time.monotonic()
        for c in [c for c in self.clients.values() if c.closing_by_s and now > c.closing_by_s]:
            self._drop(c, "did not read its replies after a protocol error")
        if self.metrics is not None:
            self.metrics.publish(render_stats(self.service), self._cron_period_s)
        if not self.notifier.enabled:
            return
        region = self.service.region
        data_bytes = region.geometry.num_extents * region.geometry.extent_bytes
        done = region.prefaulted_bytes
        pinner = self.service.gpu.pinner if self.service.gpu is not None else None
        fields: dict[str, str | int] = {}
        if pinner is not None and pinner.running and pinner.total_bytes:
            status = f"serving; pinning region {100 * pinner.pinned_bytes // pinner.total_bytes}%"
            # Pinning hundreds of GiB takes minutes: keep systemd's timeouts ahead of it.
            fields["EXTEND_TIMEOUT_USEC"] = int(4 * self._cron_period_s * 1e6)
        elif done < data_bytes and region.prefaulting:
            status = f"serving; pre-faulting region {100 * done // data_bytes}%"
        else:
            status = f"serving {len(self.clients)} clients"
        if status != self._status:
            fields["STATUS"] = self._status = status
        if self._watchdog_s is not None:
            fields["WATCHDOG"] = 1
        if fields:
            self.notifier.notify(**fields)

    def _signalled(self, sock: object, mask: int) -> None:
        with contextlib.suppress(BlockingIOError):
            sigs = self._sig_r.recv(64)
            log.info("signal %s received: draining and stopping", list(sigs))
        self._stop = True
        self.service.shutting_down = True

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.service.inflight_jobs and time.monotonic() < deadline:
            for key, mask in self.sel.select(0.05):
                if key.data == self._copies_done:
                    self._copies_done(key.fileobj, mask)
        if self.service.inflight_jobs:
            log.error(
                "%d copies still running after %.0f s", self.service.inflight_jobs, DRAIN_TIMEOUT_S
            )

    # ------------------------------------------------------------ connections

    def _accept(self, sock: object, mask: int) -> None:
        for _ in range(64):  # a burst of connections does not hold the loop either
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self.budgets.shed(self.listener)
                    log.warning("out of descriptors: shed a new connection")
                else:
                    log.warning("accept failed: %s", exc)
                return
            if self._stop or len(self.clients) >= self.budgets.max_clients:
                self.budgets.shed_total += 1
                conn.close()
                continue
            conn.setblocking(False)
            pid, uid, gid = struct.unpack(
                "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            )
            cid = self._next_id
            self._next_id += 1
            session = self.service.open_session(cid, pid, uid, gid)
            if not session.allowed:
                self._refuse(conn, session)
                continue
            client = _Client(conn, ServerConnection(self._max_frame), session)
            self.clients[cid] = client
            self.sel.register(conn, selectors.EVENT_READ, lambda s, mk, c=client: self._io(c, mk))
            log.debug("client %d connected (pid %d uid %d)", cid, pid, uid)

    def _refuse(self, conn: socket.socket, session: Session) -> None:
        """A peer the access rules refuse: one error frame, then gone."""
        reason = self.service.refusal(session)
        with contextlib.suppress(OSError):
            conn.send(encode_frame(m.ErrorReply(0, ErrorCode.PERMISSION_DENIED, reason)))
        conn.close()
        self.service.close_session(session)

    def _io(self, c: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(c)
        # nothing more is read from a client being closed after a protocol error
        alive = c.session.session_id in self.clients and not c.closing_by_s
        if mask & selectors.EVENT_READ and alive:
            self._read(c)

    def _read(self, c: _Client) -> None:
        try:
            nbytes, anc, _flags, _ = c.sock.recvmsg_into([self._rbuf], _ANC_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(c, f"read failed: {exc}")
            return
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                c.session.fds.extend(fds)
        if not nbytes:
            self._drop(c, "disconnected")
            return
        c.conn.receive_data(self._rview[:nbytes])
        self._process(c)

    def _process(self, c: _Client) -> None:
        """Dispatch the connection's complete frames, within this turn's limits."""
        self._backlog.discard(c)
        if not self._account(c):
            return
        try:
            end_s = time.perf_counter() + self._slice_s
            for _ in range(FRAMES_PER_TURN):
                if len(c.outbuf) > PAUSE_OUTPUT_BYTES:
                    break  # paused: it is read again once it has read its replies
                req = c.conn.next_event()
                if isinstance(req, NeedData):
                    break
                self._dispatch(c, req)
                if time.perf_counter() > end_s:
                    self._backlog.add(c)  # its slice is used: the others go first
                    break
            else:
                self._backlog.add(c)  # more may be buffered: the next turn goes on
        except ProtocolError as exc:
            c.outbuf += encode_frame(m.ErrorReply(0, ErrorCode.PROTOCOL_ERROR, str(exc.args[0])))
            self.service.count_error(ErrorCode.PROTOCOL_ERROR.name)
            log.warning("client %d (pid %d): %s", c.session.session_id, c.session.pid, exc)
            # Replies to the requests before the bad frame are still owed: send them
            # all, then close (or give up after LINGER_S if the client stops reading).
            c.closing_by_s = time.monotonic() + LINGER_S
            self._flush(c)
            return
        self._flush(c)

    def _account(self, c: _Client) -> bool:
        """Update what the connection holds of the budgets; cut off whoever is over."""
        b = self.budgets
        held_in, fds = c.conn.buffered_bytes, len(c.session.fds)
        b.input_bytes += held_in - c.held_in
        b.parked_fds += fds - c.held_fds
        c.held_in, c.held_fds = held_in, fds
        if not b.fds_ok(fds):
            self._cut_off(c, f"{fds} descriptors parked (global {b.parked_fds})")
            return False
        while b.memory_over() and self.clients:
            worst = max(self.clients.values(), key=lambda x: x.held_bytes)
            self._cut_off(worst, f"holds {worst.held_bytes} bytes of the buffer budget")
            if worst is c:
                return False
        return c.session.session_id in self.clients

    def _cut_off(self, c: _Client, why: str) -> None:
        self.budgets.cut_off_total += 1
        log.warning("client %d (pid %d uid %d) cut off: %s", c.session.session_id,
                    c.session.pid, c.session.uid, why)  # fmt: skip
        self._drop(c, why)

    def _dispatch(self, c: _Client, req: m.Request) -> None:
        code: ErrorCode | None = None
        try:
            reply = self.service.handle(c.session, req)
        except KVOffloadError as exc:
            code, message = exc.code, str(exc.args[0])
        except ValueError as exc:
            code, message = ErrorCode.INVALID_ARGUMENT, str(exc)
        except AssertionError:
            raise
        except Exception as exc:
            log.exception("request %s failed", type(req).__name__)
            code, message = ErrorCode.INTERNAL, f"internal error: {exc!r}"
        if code is not None:
            self.service.count_error(code.name)
            if req.rid == 0:
                self.service.refuse_one_way(c.session, req, code, message)
                reply = None
            else:
                reply = m.ErrorReply(req.rid, code, message)
        self._queue_pushes(c)  # what the request caused goes out before its reply
        if reply is not None:
            if c.session.out_fds:  # they travel with the first byte of this reply
                c.fd_marks.append((c.sent_bytes + len(c.outbuf), c.session.out_fds))
                c.session.out_fds = []
            c.outbuf += c.conn.send(reply)

    def _queue_pushes(self, c: _Client) -> None:
        if c.session.pushes:
            for push in c.session.pushes:
                c.outbuf += c.conn.send(push)
            c.session.pushes.clear()

    def _push_feeds(self) -> None:
        feeds = self.service.engines.feed_pushes
        for c in list(self.clients.values()):
            if not c.session.push_feeds or c.closing_by_s:
                continue
            sent = False
            for push in feeds(c.session, len(c.outbuf)):
                c.outbuf += c.conn.send(push)
                sent = True
            if sent:
                self._flush(c)

    def _copies_done(self, fd: object, mask: int) -> None:
        for session_id, reply in self.service.on_completions(self.service.copier.drain()):
            c = self.clients.get(session_id)
            if c is not None:
                c.outbuf += c.conn.send(reply)
                self._flush(c)

    def _flush(self, c: _Client) -> None:
        while c.outbuf:
            try:
                n = self._send_some(c)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("client %d: send failed: %s", c.session.session_id, exc)
                self._drop(c, "write failed")
                return
            del c.outbuf[:n]
            c.sent_bytes += n
        if c.closing_by_s and not c.outbuf:
            self._drop(c, "protocol error")
            return
        self.budgets.output_bytes += len(c.outbuf) - c.held_out
        c.held_out = len(c.outbuf)
        if len(c.outbuf) > MAX_OUTPUT_BYTES_PER_CLIENT:
            self._cut_off(c, "not reading its replies")
            return
        if self.budgets.memory_over() and not self._account(c):
            return
        paused = len(c.outbuf) > PAUSE_OUTPUT_BYTES or bool(c.closing_by_s)
        events = (0 if paused else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if c.outbuf else 0
        )
        if events != c.events and c.session.session_id in self.clients:
            self.sel.modify(c.sock, events, lambda s, mk, cl=c: self._io(cl, mk))
            c.events = events
            if not paused and c.conn.buffered_bytes:
                self._backlog.add(c)  # resumed: frames buffered while paused go on

    @staticmethod
    def _send_some(c: _Client) -> int:
        """Send from the output buffer; descriptors go with the byte they are marked at."""
        if not c.fd_marks:
            return c.sock.send(c.outbuf)
        pos, fds = c.fd_marks[0]
        if pos > c.sent_bytes:  # send up to the mark, without descriptors
            return c.sock.send(memoryview(c.outbuf)[: pos - c.sent_bytes])
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        n = c.sock.sendmsg([c.outbuf], anc)
        c.fd_marks.popleft()
        close_fds(fds)  # the peer has its own copies now
        return n

    def _drop(self, c: _Client, why: str) -> None:
        if self.clients.pop(c.session.session_id, None) is None:
            return
        self._backlog.discard(c)
        b = self.budgets
        b.input_bytes -= c.held_in
        b.output_bytes -= c.held_out
        b.parked_fds -= c.held_fds
        b.released_bytes += c.held_in + c.held_out
        c.held_in = c.held_out = c.held_fds = 0
        for _, fds in c.fd_marks:
            close_fds(fds)
        c.fd_marks.clear()
        log.debug("client %d (pid %d): %s", c.session.session_id, c.session.pid, why)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(c.sock)
        c.sock.close()
        self.service.close_session(c.session)


def bind_listener(path: str) -> socket.socket:
    """Bind the control socket: 0750 directory, 0660 socket. A stale socket is replaced;
    one something still answers on, or anything that is not a socket, is not."""
    secure_dir(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise UntrustedError(f"{path} exists and is not a socket; remove it")
        if socket_in_use(path):
            raise UntrustedError(f"something already serves {path}; stop it first")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(512)
    return sock
