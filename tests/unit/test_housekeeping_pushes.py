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
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_feed_push_gap import ask, frames, opened
from test_loop_clock import Clock, connected, loop  # noqa: F401 (loop: a fixture)

from kvoffload.protocol import encode_frame
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import ErrorCode
from kvoffload.protocol.packing import unpack_ids
from kvoffloadd.server.server import Server


@pytest.fixture
def idle(
    loop: tuple[Server, Clock],  # noqa: F811
    tmp_path: Path,
) -> Iterator[tuple[Server, socket.socket, int]]:
    """A connection past its Hello with namespace ns open, then idle: (the server,
    its socket, ns); closed whatever the test did."""
    server, _ = loop
    (sock,) = connected(server, tmp_path, 1)
    try:
        yield server, sock, opened(server, sock, 2)
    finally:
        sock.close()
        server.turn(0.0)


def test_a_namespace_taken_back_is_told_to_an_idle_connection(
    idle: tuple[Server, socket.socket, int],
) -> None:
    server, sock, ns = idle
    # what the table does when a newcomer takes the entry (test_namespace_table has
    # the table's side): the connection is not in a request of its own
    server.service.members.revoke(server.service.namespaces[ns])
    assert frames(sock) == []  # nothing is sent outside a turn
    server._cron()
    (notice,) = frames(sock)
    assert isinstance(notice, m.Notice) and notice.code == ErrorCode.NOT_FOUND
    assert "was taken back" in notice.message
    got = ask(server, sock, m.Lookup(3, ns, b"k" * 8, 8))
    assert isinstance(got[-1], m.ErrorReply) and "was not opened" in got[-1].message


def test_leases_taken_back_are_told_to_an_idle_connection(
    idle: tuple[Server, socket.socket, int],
) -> None:
    server, sock, ns = idle
    sock.sendall(encode_frame(m.StepBatch(0, ns, 8, want_leases=4)))  # one-way wish
    server.turn(0.0)
    (grant,) = frames(sock)
    assert isinstance(grant, m.LeaseGrant) and len(unpack_ids(grant.slots)) == 4
    index = server.service.namespaces[ns]
    server.service.members.take_back_leases(index, time.monotonic() + 1e6)  # long unused
    server._cron()
    (revoke,) = frames(sock)
    assert isinstance(revoke, m.LeaseRevoke) and revoke.slots == grant.slots
