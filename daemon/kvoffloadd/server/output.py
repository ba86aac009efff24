"""What the loop writes: replies and pushes out of each connection's buffer, and the
event feeds pushed to their subscribers.

Rules:
- ``flush`` sends what a connection has unsent until the socket would block. A
  connection with nothing left, nothing held and nothing watched changes nothing (the
  path every small reply takes); otherwise what it holds unsent is charged
  (``Charges.account_output``), epoll watches it for writing while bytes are left,
  and a connection with more than ``PAUSE_OUTPUT_BYTES`` unsent is no longer read or
  served until it has read (its buffered requests are queued again when it resumes).
- A connection closed after a protocol error is dropped once its replies are out.
- Event feeds go to the subscribers of namespaces whose feed moved, and to
  connections that fell behind their feed once they have read (``due``), each at most
  once per ``FEED_PUSH_GAP_S``: what moves within the gap goes out together after it,
  so an engine reads one or two pushes per step's I/O, not one per loop turn.
- Loop thread only.
"""

from __future__ import annotations

import errno
import logging
import select
from collections.abc import Callable

from kvoffloadd.server.clients import Charges, Client
from kvoffloadd.server.turns import TurnQueue
from kvoffloadd.service.budgets import PAUSE_OUTPUT_BYTES
from kvoffloadd.service.engines import EngineChannel

log = logging.getLogger(__name__)

# A connection's feed is pushed at most this often: a vLLM engine reads pushes once per
# step's I/O (at most every ``batch_interval_s``, 20 ms), and each push read costs a
# decode and a pass of its own, so a read finds one or two; a mirror is this much later
# at most (evicted blocks stay readable for ``mirror_grace_s``).
FEED_PUSH_GAP_S = 0.010
IN_ONLY = select.EPOLLIN  # what epoll watches for a connection with nothing to send


class Output:
    """Sends connections' unsent bytes and pushes their feeds (see the module's rules)."""

    def __init__(
        self,
        epoll: select.epoll,
        charges: Charges,
        turns: TurnQueue,
        engines: EngineChannel,
        clients: dict[int, Client],
        drop: Callable[[Client, str], None],
    ) -> None:
        self._epoll = epoll
        self._charges = charges
        self._turns = turns
        self._engines = engines
        self._clients = clients
        self._drop = drop
        self._lagging = engines.lagging  # connections behind their feed
        self.due: set[int] = set()  # connections that fell behind their feed, read

    def flush(self, c: Client) -> None:
        outbuf = c.outbuf
        while outbuf:
            try:
                n = c.sock.send(outbuf) if not c.fd_marks else c.send_some()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("client %d: send failed: %s", c.session.session_id, exc)
                self._drop(c, "write failed")
                return
            if n == len(outbuf):
                outbuf.clear()
            else:
                del outbuf[:n]
            c.sent_bytes += n
        if not outbuf and c.events == IN_ONLY and not c.held_out and not c.closing_by_s:
            # all of it went out, and nothing was held or watched for: nothing changes
            if self._lagging and c.session.session_id in self._lagging:
                self._lagging.discard(c.session.session_id)
                self.due.add(c.session.session_id)  # it fell behind and has read
            return
        if c.closing_by_s and not outbuf:
            self._drop(c, "protocol error")
            return
        if not self._charges.account_output(c):
            return
        cid, left = c.session.session_id, len(outbuf)
        paused = left > PAUSE_OUTPUT_BYTES or bool(c.closing_by_s)
        events = (0 if paused else select.EPOLLIN) | (select.EPOLLOUT if left else 0)
        if events != c.events:
            self._epoll.modify(c.fd, events)
            c.events = events
            if not paused and (pending := c.pending_bytes()):
                self._turns.wake(cid, pending, c.session.uid)  # resumed: buffered while paused
        if not paused and cid in self._lagging:
            self._lagging.discard(cid)
            self.due.add(cid)  # it fell behind its feed and has read: try again

    def push_feeds(self, now_s: float) -> None:
        """Push the feeds that moved, to each connection at most once per
        ``FEED_PUSH_GAP_S``; a connection inside its gap stays due."""
        feeds = self._engines.feed_pushes
        due = self._engines.due()
        if self.due:
            due |= self.due
            self.due.clear()
        for cid in due:
            c = self._clients.get(cid)
            if c is None or c.closing_by_s:
                continue
            if now_s - c.fed_at_s < FEED_PUSH_GAP_S:
                self.due.add(cid)
                continue
            sent = False
            for push in feeds(c.session, len(c.outbuf)):
                c.conn.send_into(push, c.outbuf)
                sent = True
            if sent:
                c.fed_at_s = now_s
                self.flush(c)
