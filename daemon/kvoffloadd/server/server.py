"""The event loop: sockets, file descriptors, signals, timers. Owns no metadata rules.

One thread runs everything that touches metadata: it accepts clients, reads frames
(``recvmsg``, so SCM_RIGHTS descriptors arrive with them), feeds each client's
sans-IO ``ServerConnection``, hands requests to the ``Service`` and writes replies.
Copier threads wake it through an eventfd; signals through ``signal.set_wakeup_fd``.

Rules:
- A protocol error (bad frame, oversized frame, unknown tag, request before Hello)
  gets one ``ErrorReply(rid=0, PROTOCOL_ERROR)`` and that connection is closed;
  everyone else is unaffected (invariant 6).
- Connections come and go through ``admission``: refused peers (access rules, or
  their uid's or everyone's connections in the ledger) get one error frame and are
  closed; a dropped connection leaves the loop at once, and what its session held is
  released later as units of loop work. What each connection's socket holds is
  charged to it, its uid and everyone in the ledger (``clients``).
- Loop time: connections with work are served one unit at a time (a request, or one
  slice of a large engine batch) by start-time fair queueing on the loop time each
  used (turns.py); a turn serves ``TURN_S`` in total (past it, the unit in progress and
  at most one queued unit), requests served as they are read included, then polls; it
  reads at most ``READY_PER_TURN`` ready connections; when more are ready they are
  shared out among their uids and the rest wait for the next turns (``ready``), so a
  connection waits to be read behind its uid's share of a turn's reads, not behind
  every connection another uid has ready. A turn of ``SLOW_TURN_S`` or more is logged
  with where its time went (``slowturns``). A unit is charged its wall time;
  one served from the queue no more than the loop thread's CPU time (what the kernel
  gave other work meanwhile is no connection's; ``_serve``). A connection with more
  than ``PAUSE_OUTPUT_BYTES`` of replies unsent is not served (it must read first).
- One-way requests (rid 0) get no reply; a refused one becomes a push. Pushes the
  service queued (``Session.pushes``) go out after each request and each drain of copy
  completions. Replies and pushes are written out, and event feeds pushed (each
  connection's at most once per ``FEED_PUSH_GAP_S``), by ``output``; the loop wakes
  after the gap for what it held back.
- An ``AssertionError`` is a broken internal invariant: log the stats, exit non-zero.
- SIGTERM/SIGINT: stop accepting, drain in-flight copies, close, unlink, exit 0.
- The cron (every second, or every half watchdog interval when shorter) runs the
  service's housekeeping and the ``heartbeat``: a stats snapshot to the metrics
  endpoint, progress (STATUS=) and liveness (WATCHDOG=1) to systemd. Its time counts
  in the loop-turn histogram like a turn's: a client waits behind it the same way.
"""

from __future__ import annotations

import array
import contextlib
import logging
import select
import signal
import socket
import time
from collections.abc import Callable

from kvoffload.protocol import NeedData, encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode, KVOffloadError, ProtocolError
from kvoffloadd import loopthread
from kvoffloadd.copies.closer import received_fds
from kvoffloadd.server import ready as readyshare
from kvoffloadd.server.admission import REAPER, Admission
from kvoffloadd.server.clients import Client
from kvoffloadd.server.heartbeat import Heartbeat
from kvoffloadd.server.metrics import MetricsEndpoint
from kvoffloadd.server.output import FEED_PUSH_GAP_S, Output
from kvoffloadd.server.slowturns import SLOW_TURN_S, ServePhase, SlowTurns
from kvoffloadd.server.systemd import Notifier
from kvoffloadd.server.turns import TurnQueue
from kvoffloadd.service.budgets import PAUSE_OUTPUT_BYTES, TURN_S
from kvoffloadd.service.engines import split_batch
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session
from kvoffloadd.service.stats import render_stats

log = logging.getLogger(__name__)

RECV_BYTES = 256 * 1024
MAX_FDS_PER_MSG = 253
DRAIN_TIMEOUT_S = 30.0
CRON_CATCH_UP_S = 0.05  # housekeeping that left expiries comes back this soon
LINGER_S = 5.0  # how long a client closed for a protocol error has to read its replies
# A request this small (a lookup of a thousand keys), with nobody waiting and the turn's
# budget not spent, is served as it is read; anything else is buffered and queued.
INLINE_BYTES = 64 << 10
CPU_READ_S = 0.001  # queued units: the loop thread's CPU clock read after this much wall
_ANC_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_MSG * array.array("i").itemsize)
# what epoll reports: hang-ups and errors count as both (a read or send then says which)
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_WRITABLE = select.EPOLLOUT | select.EPOLLHUP | select.EPOLLERR


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
        listener.setblocking(False)
        # epoll itself, not selectors: its wrapper costs a lookup and a tuple per event
        self._epoll = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}  # fd -> handler(events)
        self._ready = readyshare.ReadyShare(lambda n: self._epoll.poll(0.0, n))
        # connections with work, served fairly; on the clock the loop times units with
        self.turns = TurnQueue(time.perf_counter)
        self._queued = self.turns.queued  # tested for work without a call
        self.admission = Admission(service, listener, self._epoll, self._ready, self.turns)
        self.clients = self.admission.clients
        self._by_fd = self.admission.by_fd
        self._charges = self.admission.charges
        self._drop = self.admission.drop
        self._watch(listener.fileno(), self.admission.accept)
        self._watch(service.copier.wake_fd, self._copies_done)
        if service.tiering is not None:
            tiering = service.tiering
            self._watch(tiering.wake.fd, lambda events: tiering.on_wake())
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self._watch(self._sig_r.fileno(), self._signalled)
        # when the loop's work that is charged (or not) last ended: a unit's loop time
        # runs from here to its end, so one clock reading ends a unit and starts the next
        self._stamp = 0.0
        self._turn_end_s = 0.0  # when this turn's budget (TURN_S) is spent
        self._served = ServePhase()  # what the last serving of queued units did
        self.slow_turns = SlowTurns(self.admission.describe)
        self.budgets = service.budgets
        self.output = Output(
            self._epoll, self._charges, self.turns, service.engines, self.clients, self._drop
        )
        self._flush = self.output.flush
        self._push_due = self.output.due  # pushes held back by the gap (never replaced)
        self._record_turn = service.loop.record
        self._push_subs = service.engines.push_subs  # namespaces whose feeds are pushed
        self._stop = False
        self.heartbeat = Heartbeat(service, self.notifier, metrics)
        # One preallocated receive buffer: allocating a fresh 256 KiB bytes object per
        # recvmsg costs more than the rest of a ping (research/stack.md section 4).
        self._rbuf = bytearray(RECV_BYTES)
        self._rbufs = [self._rbuf]
        self._rview = memoryview(self._rbuf)

    def _watch(self, fd: int, handler: Callable[[int], None]) -> None:
        self._handlers[fd] = handler
        self._epoll.register(fd, select.EPOLLIN)

    # ------------------------------------------------------------ main loop

    def catch_signals(self) -> None:
        """Turn SIGTERM/SIGINT into a graceful stop; call before announcing readiness,
        or a stop request that comes right after start-up kills the daemon outright."""
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)

    def serve_forever(self) -> None:
        self.catch_signals()
        period_s = self.heartbeat.period_s
        next_cron = next_beat = time.monotonic() + period_s
        loopthread.claim()
        try:
            while not self._stop:
                now = time.monotonic()
                if now >= next_cron:
                    full = now >= next_beat
                    behind = self._cron(full)
                    self._record_turn(time.monotonic() - now)  # loop time like any turn's
                    now = time.monotonic()
                    if full:
                        next_beat = now + period_s
                    next_cron = min(next_beat, now + CRON_CATCH_UP_S) if behind else next_beat
                wait_s = 0.0 if self._queued else next_cron - now
                if self._push_due:  # pushes held back by the gap go out after it
                    wait_s = min(wait_s, FEED_PUSH_GAP_S)
                self.turn(wait_s)
            self.notifier.notify(STOPPING=1, STATUS="draining in-flight copies")
            self._drain()
        except AssertionError:
            log.critical("internal invariant broken; stats: %s", render_stats(self.service))
            raise
        finally:
            loopthread.release()
            signal.set_wakeup_fd(-1)
            self.close()

    def close(self) -> None:
        """Drop every connection, release what each held, and close what the loop made
        (its epoll, its signal socketpair, the descriptor reserve); the listener stays
        its owner's."""
        self.admission.close()
        self._epoll.close()
        self.budgets.close()
        self._sig_r.close()
        self._sig_w.close()

    def turn(self, timeout_s: float) -> None:
        """One turn of the loop: wait up to ``timeout_s`` for input, completions or
        signals, handle them, serve queued work for up to ``TURN_S`` and push feeds."""
        pending, per_turn = self._ready.pending, readyshare.READY_PER_TURN
        ready = self._epoll.poll(0.0 if pending else timeout_s, per_turn)
        if pending or len(ready) == per_turn:
            ready = self._ready.share(ready, self._uid_of)
        t0 = self._stamp = time.perf_counter()
        self._turn_end_s = t0 + TURN_S
        by_fd = self._by_fd
        for fd, events in ready:
            c = by_fd.get(fd)
            if c is None:
                handler = self._handlers.get(fd)
                if handler is not None:
                    handler(events)
                    self._stamp = time.perf_counter()
                continue
            if events & _WRITABLE and not c.closed:
                self._flush(c)
                self._stamp = time.perf_counter()
            # nothing more is read from a client being closed after a protocol error
            if events & _READABLE and not c.closed and not c.closing_by_s and not self._read(c):
                self._stamp = time.perf_counter()  # what was read was queued, not served
        busy = bool(self._queued)
        reads_end_s = self._stamp
        if busy:
            self._serve(self._turn_end_s)
        if self._push_subs or self._push_due:
            self.output.push_feeds(self._stamp)
            self._stamp = time.perf_counter()
        if ready or busy:  # self._stamp: when the last of the work above ended
            spent_s = self._stamp - t0
            self._record_turn(spent_s)
            if spent_s >= SLOW_TURN_S:
                served = self._served if busy else None
                self.slow_turns.turn(spent_s, len(ready), reads_end_s - t0, served, self._stamp)

    def _uid_of(self, fd: int) -> int | None:
        c = self._by_fd.get(fd)
        return None if c is None else c.session.uid

    def _cron(self, full: bool = True) -> bool:
        """Housekeeping (``full``: the heartbeat's too, once a period); whether it left
        expiries for a call soon (``CRON_CATCH_UP_S``)."""
        behind = self.service.cron()
        for cid in self.service.pushes_due:  # what housekeeping told connections
            c = self.clients.get(cid)
            if c is not None:
                c.queue_pushes()
                self._flush(c)
        self.service.pushes_due.clear()
        if not full:
            return behind
        self.budgets.trim()
        now = time.monotonic()
        for c in [c for c in self.clients.values() if c.closing_by_s and now > c.closing_by_s]:
            self._drop(c, "did not read its replies after a protocol error")
        self.heartbeat.beat(len(self.clients))
        return behind

    def _signalled(self, events: int) -> None:
        with contextlib.suppress(BlockingIOError):
            sigs = self._sig_r.recv(64)
            log.info("signal %s received: draining and stopping", list(sigs))
        self._stop = self.admission.stopping = True
        self.service.shutting_down = True

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.service.inflight_jobs and time.monotonic() < deadline:
            for fd, events in self._epoll.poll(0.05):
                if fd == self.service.copier.wake_fd:
                    self._copies_done(events)
        if self.service.inflight_jobs:
            log.error(
                "%d copies still running after %.0f s", self.service.inflight_jobs, DRAIN_TIMEOUT_S
            )

    # ------------------------------------------------------------ connections

    def _read(self, c: Client) -> bool:
        """Read what ``c`` sent and serve it now if it is one whole small request,
        nobody waits and the turn's budget is not spent (requests served as they are
        read count in the turn's ``TURN_S`` like queued ones); else buffer (and charge)
        it and queue ``c``. Whether a unit was served (its loop time, from
        ``self._stamp`` on, charged and the clock read)."""
        try:
            nbytes, anc, _flags, _ = c.sock.recvmsg_into(self._rbufs, _ANC_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._drop(c, f"read failed: {exc}")
            return False
        if anc:
            self._park_fds(c, anc)
        elif not c.outbuf and self._may_serve_now(c, nbytes):
            # One whole small request, nothing buffered, nobody waiting: served now, from
            # the receive buffer (never buffered, so it holds nothing to charge), and its
            # loop time (its read included) charged to its connection and uid like any
            # unit's; a ping's round trip pays for no queueing.
            try:
                req = c.conn.request_in(self._rview, nbytes)
            except ProtocolError as exc:
                more = self._protocol_error(c, exc)
            else:
                if req is None:  # not one whole frame (or the end of the stream)
                    more = -1
                elif type(req) is m.StepBatch:
                    more = self._unit(c, req)
                else:
                    self._dispatch(c, req)
                    if not c.closed:
                        self._flush(c)
                    more = 0  # nothing was buffered: it has no more work
            if more >= 0:
                s = c.session
                t1 = time.perf_counter()
                self.turns.served(s.session_id, t1 - self._stamp, 0 if c.closed else more,
                                  s.uid, t1, c.closed)  # fmt: skip
                self._stamp = t1
                return True
        if not nbytes:
            self._drop(c, "disconnected")
            return False
        c.conn.receive_data(self._rview[:nbytes])
        if not self._charges.account(c):
            return False
        cid, pending = c.session.session_id, c.conn.buffered_bytes
        if not self._may_serve_now(c, pending):
            self.turns.wake(cid, pending, c.session.uid)
            return False
        # Nobody waits and the request is small: serve it now, as above.
        more = self._serve_one(c)
        t1 = time.perf_counter()
        self.turns.served(
            cid, t1 - self._stamp, 0 if c.closed else more, c.session.uid, t1, c.closed
        )
        self._stamp = t1
        return True

    def _may_serve_now(self, c: Client, nbytes: int) -> bool:
        """Whether ``nbytes`` of ``c``'s request may be served as they are read: small,
        nobody queued, no slices of a batch left, the turn's budget not spent."""
        return (
            nbytes <= INLINE_BYTES
            and not self._queued
            and not c.parts
            and self._stamp < self._turn_end_s
        )

    def _park_fds(self, c: Client, anc: list[tuple[int, int, bytes]]) -> None:
        """Descriptors that came with the bytes: the session's until a request claims
        them (charged with the bytes, ``Charges.account``)."""
        c.session.fds.extend(received_fds(anc))

    def _serve(self, end_s: float) -> None:
        """Serve queued connections one unit at a time, fairly, until ``end_s``. A unit
        is charged its wall time, but no more than the loop thread's CPU time since the
        clock was last read (at most ``CPU_READ_S`` of wall before it): while others
        wait the machine is busy too, and a unit during which the kernel ran something
        else for milliseconds would put its connection that far behind the others of
        its uid (a ping charged 4 ms went behind a round of 31 connections' 1.5 ms
        units: 100 ms). Reading the CPU clock is a system call, so short units share
        one reading; what one is overcharged stays under ``CPU_READ_S``. The turn's
        budget (``end_s``) is wall time."""
        turns, clients, cpu_s = self.turns, self.clients, time.thread_time
        t0 = t_read = self._stamp
        c_read = cpu_s()
        phase = self._served
        phase.started_s, phase.started_cpu_s = t0, c_read
        units, longest_s, longest_of = 0, 0.0, -1
        while (cid := turns.next()) is not None:
            c = clients.get(cid)
            if c is not None:
                more = self._serve_one(c)
                uid, gone = c.session.uid, c.closed
            elif cid == REAPER and self.admission.leaving:
                more, uid, gone = self.admission.reap(), None, False
            else:
                continue
            t1 = time.perf_counter()
            cost_s = wall_s = t1 - t0
            if t1 - t_read >= CPU_READ_S:
                c1 = cpu_s()
                cost_s = min(cost_s, c1 - c_read)
                t_read, c_read = t1, c1
            turns.served(cid, cost_s, 0 if gone else more, uid, t1, gone)
            t0 = self._stamp = t1
            units += 1
            if wall_s > longest_s:
                longest_s, longest_of = wall_s, cid
            if t1 >= end_s:
                break
        phase.units, phase.longest_s, phase.longest_of = units, longest_s, longest_of

    def _serve_one(self, c: Client) -> int:
        """Dispatch one unit of ``c``'s work; the bytes of work it has left now (0:
        none it can do now)."""
        if len(c.outbuf) > PAUSE_OUTPUT_BYTES or c.closing_by_s:
            return 0  # paused: woken again once it has read its replies
        try:
            if c.parts:
                return self._unit(c, c.parts.popleft(), split=False)
            req = c.conn.next_event()
            if isinstance(req, NeedData):
                return 0
            return self._unit(c, req)
        except ProtocolError as exc:
            return self._protocol_error(c, exc)

    def _unit(self, c: Client, req: m.Request, split: bool = True) -> int:
        """Handle one request (the first slice of a large batch), send what it caused;
        the bytes of work ``c`` has left."""
        if split and type(req) is m.StepBatch:
            parts = split_batch(req)
            req = parts[0]
            c.parts.extend(parts[1:])
        self._dispatch(c, req)
        if c.closed:
            return 0  # cut off by what the request made it hold
        self._flush(c)
        return c.pending_bytes()

    def _protocol_error(self, c: Client, exc: ProtocolError) -> int:
        c.outbuf += encode_frame(m.ErrorReply(0, ErrorCode.PROTOCOL_ERROR, str(exc.args[0])))
        self.service.count_error(ErrorCode.PROTOCOL_ERROR.name)
        log.warning("client %d (pid %d): %s", c.session.session_id, c.session.pid, exc)
        # Replies to the requests before the bad frame are still owed: send them
        # all, then close (or give up after LINGER_S if the client stops reading).
        c.closing_by_s = time.monotonic() + LINGER_S
        self._flush(c)
        return 0

    def _dispatch(self, c: Client, req: m.Request) -> None:
        s = c.session
        try:
            reply = self.service.handle(s, req)
        except AssertionError:
            raise
        except Exception as exc:
            reply = self._failed(s, req, exc)
        if s.pushes:  # what the request caused goes out before its reply
            c.queue_pushes()
        if reply is not None:
            if s.out_fds:
                c.queue_reply(reply)
            else:  # queue_reply, written out: once per request
                c.conn.send_into(reply, c.outbuf)
        if len(s.fds) != c.held_fds:
            self._charges.account(c)  # the request claimed parked descriptors

    def _failed(self, s: Session, req: m.Request, exc: Exception) -> m.Reply | None:
        """The error reply to a request whose handler raised ``exc`` (None for a
        one-way request: a refused one becomes a push)."""
        if isinstance(exc, KVOffloadError):
            code, message = exc.code, str(exc.args[0])
        elif isinstance(exc, ValueError):
            code, message = ErrorCode.INVALID_ARGUMENT, str(exc)
        else:
            log.error("request %s failed", type(req).__name__, exc_info=exc)
            code, message = ErrorCode.INTERNAL, f"internal error: {exc!r}"
        self.service.count_error(code.name)
        if req.rid == 0:
            self.service.refuse_one_way(s, req, code, message)
            return None
        return m.ErrorReply(req.rid, code, message)

    def _copies_done(self, events: int) -> None:
        for session_id, reply in self.service.on_completions(self.service.copier.drain()):
            c = self.clients.get(session_id)
            if c is not None:
                c.queue_reply(reply)
                self._flush(c)
