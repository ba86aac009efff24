"""One connection as the loop holds it, and what it is charged in the ledger for it.

Rules:
- A ``Client`` is one accepted connection: its socket, its sans-IO
  ``ServerConnection``, its session, the replies not yet sent (with the descriptors
  marked to go out with a byte of them) and the slices of a large batch it has left.
- What the socket makes the daemon hold is charged to the connection, its uid and
  everyone in the ledger (``kvoffloadd.ledger``) by ``Charges``: its buffered request
  and reply bytes, rounded up to ``CHARGE_STEP_BYTES`` so a small request changes
  nothing, and the descriptors it parked. Past a limit the connection (its own limit),
  or the largest holder of its uid or of everyone, is cut off; what goes with the
  socket is given back when it is dropped (``Charges.release``).
- Descriptors in a reply travel with its first byte: ``send_some`` never sends past a
  mark without them, and closes the daemon's copies once they are out.
- Loop thread only.
"""

from __future__ import annotations

import array
import logging
import math
import select
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload.protocol import ServerConnection
from kvoffload.protocol import messages as m
from kvoffloadd.copies.closer import close_own_fds
from kvoffloadd.ledger import Ledger, Line
from kvoffloadd.service.budgets import MAX_OUTPUT_BYTES_PER_CLIENT, Budgets
from kvoffloadd.service.session import Session

log = logging.getLogger(__name__)

CHARGE_STEP_BYTES = 16 << 10  # buffered bytes are charged in steps of this, rounded up


@dataclass(eq=False, slots=True)  # one per connection, kept in sets by identity
class Client:
    sock: socket.socket
    conn: ServerConnection
    session: Session
    fd: int
    closed: bool = False  # dropped: events already polled for it are ignored
    outbuf: bytearray = field(default_factory=bytearray)
    sent_bytes: int = 0  # everything ever sent, to place descriptors in the stream
    # (stream position, fds): descriptors that go out with the byte at that position
    fd_marks: deque[tuple[int, list[int]]] = field(default_factory=deque)
    events: int = select.EPOLLIN  # what epoll watches for it now
    closing_by_s: float = 0.0  # after a protocol error: deliver the replies, then close
    # what this connection has charged to the ledger for its buffers and parked fds
    held_in: int = 0
    held_out: int = 0
    held_fds: int = 0
    parts: deque[m.Request] = field(default_factory=deque)  # slices of a large batch
    fed_at_s: float = -math.inf  # when its feed was last pushed (loop clock)

    def pending_bytes(self) -> int:
        """The size of its next unit of work: its next slice of a batch, else the bytes
        of requests it has buffered (0: nothing to do)."""
        if self.parts:
            p = self.parts[0]
            assert isinstance(p, m.StepBatch)
            return len(p.claim_keys) + len(p.pin_keys) + len(p.unpin_keys) + len(p.touch_keys)
        return self.conn.buffered_bytes

    def queue_reply(self, reply: m.Reply) -> None:
        session = self.session
        fds = session.out_fds.pop(reply.rid, None) if session.out_fds else None
        if fds:  # they travel with the first byte of this reply
            self.fd_marks.append((self.sent_bytes + len(self.outbuf), fds))
        self.conn.send_into(reply, self.outbuf)

    def queue_pushes(self) -> None:
        pushes = self.session.pushes
        if pushes:
            for push in pushes:
                self.conn.send_into(push, self.outbuf)
            pushes.clear()

    def send_some(self) -> int:
        """Send from the output buffer up to the next descriptors' mark, or from the
        mark with the descriptors (they go with the byte they are marked at)."""
        pos, fds = self.fd_marks[0]
        if pos > self.sent_bytes:  # send up to the mark, without descriptors
            return self.sock.send(memoryview(self.outbuf)[: pos - self.sent_bytes])
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        n = self.sock.sendmsg([self.outbuf], anc)
        self.fd_marks.popleft()
        close_own_fds(fds)  # the peer has its own copies now
        return n


def charged_bytes(nbytes: int) -> int:
    """Bytes as the ledger is charged them: in steps of ``CHARGE_STEP_BYTES``, up."""
    return -(-nbytes // CHARGE_STEP_BYTES) * CHARGE_STEP_BYTES


class Charges:
    """The ledger's lines for what connections' sockets hold, kept up to date as they
    read and write; ``drop`` disconnects a client that is cut off."""

    def __init__(
        self,
        ledger: Ledger,
        budgets: Budgets,
        clients: dict[int, Client],
        drop: Callable[[Client, str], None],
    ) -> None:
        self.budgets = budgets
        self.clients = clients
        self._drop = drop
        self.buffered: Line = ledger["buffered_bytes"]
        self.descriptors: Line = ledger["descriptors"]
        self.connections: Line = ledger["connections"]

    def account(self, c: Client) -> bool:
        """Charge the connection's buffered bytes and parked descriptors; cut off
        whoever is over a limit. Whether ``c`` is still connected."""
        held_in, fds = charged_bytes(c.conn.buffered_bytes), len(c.session.fds)
        if held_in == c.held_in and fds == c.held_fds:
            return True
        cid = c.session.session_id
        _charge(self.buffered, cid, held_in - c.held_in)
        _charge(self.descriptors, cid, fds - c.held_fds)
        c.held_in, c.held_fds = held_in, fds
        for line in (self.descriptors, self.buffered):
            self._enforce(line, c)
        return cid in self.clients

    def account_output(self, c: Client) -> bool:
        """Charge the replies ``c`` has not read yet; cut it off past
        ``MAX_OUTPUT_BYTES_PER_CLIENT`` or a limit. Whether ``c`` is still connected."""
        left = len(c.outbuf)
        if (left or c.held_out) and (held_out := charged_bytes(left)) != c.held_out:
            _charge(self.buffered, c.session.session_id, held_out - c.held_out)
            c.held_out = held_out
            if left > MAX_OUTPUT_BYTES_PER_CLIENT:
                self.cut_off(c, "not reading its replies")
                return False
            self._enforce(self.buffered, c)
        return not c.closed

    def release(self, c: Client) -> None:
        """Give back what goes with ``c``'s socket (it is being dropped); what its
        session holds is released with the session."""
        cid = c.session.session_id
        self.budgets.released_bytes += c.held_in + c.held_out
        _charge(self.buffered, cid, -(c.held_in + c.held_out))
        _charge(self.descriptors, cid, -c.held_fds)
        self.connections.give(cid, 1)
        c.held_in = c.held_out = c.held_fds = 0

    def cut_off(self, c: Client, why: str) -> None:
        self.budgets.cut_off_total += 1
        log.warning("client %d (pid %d uid %d) cut off: %s", c.session.session_id,
                    c.session.pid, c.session.uid, why)  # fmt: skip
        self._drop(c, why)

    def _enforce(self, line: Line, c: Client) -> None:
        """What arrived is held already: past a limit, cut off the connection (its own
        limit) or the largest holder of its uid, or of everyone."""
        cid = c.session.session_id
        while cid in self.clients and (scope := line.excess(cid)):
            if scope == "connection":
                victim = c
            else:
                pool = [
                    x
                    for x in self.clients.values()
                    if scope == "total" or x.session.uid == c.session.uid
                ]
                victim = max(pool, key=lambda x: line.held(x.session.session_id))
            held = line.held(victim.session.session_id)
            if not held:
                return  # what is over is held by connections already gone
            self.cut_off(victim, f"holds {held} {line.what} (over the {scope} limit)")


def _charge(line: Line, cid: int, delta: int) -> None:
    if delta > 0:
        line.add(cid, delta)
    elif delta < 0:
        line.give(cid, -delta)
