"""Who gets a connection, and what leaves with one: accept, refuse, drop, release.

Rules:
- A peer the access rules refuse gets one ``ErrorReply(rid=0, PERMISSION_DENIED)``,
  one whose uid or everyone holds every connection it may one ``QUOTA_EXCEEDED``
  (the ledger's ``connections`` line), and is closed at once: it holds no slot and
  parks nothing. At EMFILE the reserve descriptor lets ``accept`` shed the new
  connection; once stopping, new connections are shed too.
- An accepted connection is a ``Client`` the loop polls for input; a burst of
  connections takes at most ``ACCEPTS_PER_WAKE`` accepts per wake.
- ``drop`` takes a connection out of the loop at once: its socket, what its socket
  held in the ledger (``Charges.release``), the descriptors it parked or had queued,
  its place in the turn queue and among the ready. What its session held (namespaces,
  pins, stores, leases) is released later, ``RELEASE_SLICE`` at a time, as units of
  loop work of the turn queue's ``REAPER`` among the others (``reap``): a thousand
  connections closing at once cost their readers nothing.
- Loop thread only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
from collections import deque

from kvoffload.protocol import ServerConnection, encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode
from kvoffloadd.copies.closer import close_fds, close_own_fds
from kvoffloadd.server.clients import Charges, Client
from kvoffloadd.server.listener import peer_credentials
from kvoffloadd.server.ready import ReadyShare
from kvoffloadd.server.turns import TurnQueue
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)

ACCEPTS_PER_WAKE = 64  # a burst of connections does not hold the loop either
REAPER = 0  # the turn queue's id for releasing what connections that left held
LEAVING_BYTES = 64 << 10  # a leaver's release, as bytes of work: a heavy unit
RELEASE_SLICE = 2048  # stores and pinned keys per namespace one unit of release drops


class Admission:
    """The loop's connections (``clients``, by session id; ``by_fd``) as they come
    and go."""

    def __init__(
        self,
        service: Service,
        listener: socket.socket,
        epoll: select.epoll,
        ready: ReadyShare,
        turns: TurnQueue,
    ) -> None:
        self.service = service
        self.listener = listener
        self.budgets = service.budgets
        self.ledger = service.ledger
        self._epoll = epoll
        self._ready = ready
        self._turns = turns
        self._max_frame = service.config.max_frame_bytes
        self.clients: dict[int, Client] = {}
        self.by_fd: dict[int, Client] = {}  # client connections' descriptors
        self.charges = Charges(self.ledger, self.budgets, self.clients, self.drop)
        self.leaving: deque[Session] = deque()  # connections gone, to be released
        self.stopping = False  # shed what connects from now on
        self._next_id = REAPER + 1

    def accept(self, events: int) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
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
            if self.stopping:
                self.budgets.shed_total += 1
                close_fds([conn.detach()])
                continue
            conn.setblocking(False)
            pid, uid, gid = peer_credentials(conn)
            cid = self._next_id
            self._next_id += 1
            session = self.service.open_session(cid, pid, uid, gid)
            if not session.allowed:
                self._refuse(conn, session, ErrorCode.PERMISSION_DENIED)
                continue
            if self.ledger.take(cid, {"connections": 1}):
                self.budgets.shed_total += 1
                self._refuse(conn, session, ErrorCode.QUOTA_EXCEEDED)
                continue
            client = Client(conn, ServerConnection(self._max_frame), session, conn.fileno())
            self.clients[cid] = client
            self.by_fd[client.fd] = client
            self._epoll.register(client.fd, select.EPOLLIN)
            log.debug("client %d connected (pid %d uid %d)", cid, pid, uid)

    def _refuse(self, conn: socket.socket, session: Session, code: ErrorCode) -> None:
        """One error frame, then gone."""
        reason = self.service.refusal(session, code)
        with contextlib.suppress(OSError):
            conn.send(encode_frame(m.ErrorReply(0, code, reason)))
        close_fds([conn.detach()])  # what it queued already goes with it: off the loop
        self.service.close_session(session)

    def describe(self, cid: int) -> str:
        """Who a turn-queue id stands for, in a log line."""
        c = self.clients.get(cid)
        if c is not None:
            return f"client {cid} (pid {c.session.pid} uid {c.session.uid})"
        return "releasing what leavers held" if cid == REAPER else f"client {cid} (gone)"

    def drop(self, c: Client, why: str) -> None:
        if self.clients.pop(c.session.session_id, None) is None:
            return
        c.closed = True
        self.by_fd.pop(c.fd, None)
        self._ready.forget(c.fd)
        self._turns.drop(c.session.session_id)
        # What goes with the socket goes from the ledger now; the rest when released.
        self.charges.release(c)
        close_fds(c.session.fds)  # descriptors it parked that no message claimed
        c.session.fds = []
        c.parts.clear()
        for _, fds in c.fd_marks:  # the daemon's own, not yet sent
            close_own_fds(fds)
        c.fd_marks.clear()
        log.debug("client %d (pid %d): %s", c.session.session_id, c.session.pid, why)
        with contextlib.suppress(OSError):
            self._epoll.unregister(c.fd)
        close_fds([c.sock.detach()])  # descriptors it queued go with it: off the loop
        self.leaving.append(c.session)
        self._turns.wake(REAPER, LEAVING_BYTES)

    def reap(self) -> int:
        """Release a slice of what the first connection that left held; the work left
        (bytes)."""
        if self.service.close_session(self.leaving[0], RELEASE_SLICE):
            self.leaving.popleft()
        return LEAVING_BYTES if self.leaving else 0

    def close(self) -> None:
        """Drop every connection and release all that each held."""
        for c in list(self.clients.values()):
            self.drop(c, "daemon stopping")
        while self.leaving:
            self.reap()
