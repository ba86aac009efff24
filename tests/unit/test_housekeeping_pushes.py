"""What housekeeping takes from a connection reaches it while it sends nothing.

A real ``Server`` and ``Service`` in this process (test_loop_clock's fixture): a
connection opens a namespace and goes idle; the daemon then takes something back from
it outside any request of its own (its unused leases; the namespace itself, as the
table does for a uid below its share), and the next housekeeping turn must push it
the news. Waiting for the connection's next request would leave an idle engine
holding slots or a namespace it no longer has, unaware.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from test_feed_push_gap import ask, frames, opened
from test_loop_clock import Clock, connected, loop  # noqa: F401 (loop: a fixture)

from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode
from kvoffloadd.server.server import Server


def test_a_namespace_taken_back_is_told_to_an_idle_connection(
    loop: tuple[Server, Clock],  # noqa: F811
    tmp_path: Path,
) -> None:
    server, _ = loop
    (idle,) = connected(server, tmp_path, 1)
    ns = opened(server, idle, 2)
    index = server.service.namespaces[ns]
    server.service.members.revoke(index)  # what the table does for a newcomer
    assert frames(idle) == []  # nothing goes out within another's request
    server._cron()
    (notice,) = frames(idle)
    assert isinstance(notice, m.Notice) and notice.code == ErrorCode.NOT_FOUND
    assert "was taken back" in notice.message
    got = ask(server, idle, m.Lookup(3, ns, b"k" * 8, 8))
    assert isinstance(got[-1], m.ErrorReply) and "was not opened" in got[-1].message
    _close(server, idle)


def test_leases_taken_back_are_told_to_an_idle_connection(
    loop: tuple[Server, Clock],  # noqa: F811
    tmp_path: Path,
) -> None:
    server, _ = loop
    (idle,) = connected(server, tmp_path, 1)
    ns = opened(server, idle, 2)
    idle.sendall(encode_frame(m.StepBatch(0, ns, 8, want_leases=4)))  # one-way wish
    server.turn(0.0)
    (grant,) = frames(idle)
    assert isinstance(grant, m.LeaseGrant) and len(m.unpack_ids(grant.slots)) == 4
    index = server.service.namespaces[ns]
    server.service.members.take_back_leases(index, time.monotonic() + 1e6)  # long unused
    server._cron()
    (revoke,) = frames(idle)
    assert isinstance(revoke, m.LeaseRevoke) and revoke.slots == grant.slots
    _close(server, idle)


def _close(server: Server, sock: socket.socket) -> None:
    sock.close()
    server.turn(0.0)
