"""The closer: descriptors peers sent are closed off the calling thread, and a socket
whose close would wait out its linger time is closed at once."""

from __future__ import annotations

import array
import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from kvoffloadd.copies.closer import close_fds

LINGER_S = 60


@pytest.fixture
def lingering() -> Iterator[socket.socket]:
    """A TCP socket with unsent data that nobody reads and a 60 s linger: its last
    close waits until the data is gone or the minute is over."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        tcp = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()  # never reads
        tcp.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                tcp.send(b"x" * 65536)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, LINGER_S))
        yield tcp
        peer.close()


def is_open(fd: int) -> bool:
    return os.path.exists(f"/proc/self/fd/{fd}")


def wait_closed(fd: int) -> None:
    deadline = time.monotonic() + 10  # far below the linger time
    while is_open(fd):
        assert time.monotonic() < deadline, "the descriptor was not closed"
        time.sleep(0.01)


def test_a_lingering_socket_is_closed_without_waiting_out_its_linger(
    lingering: socket.socket,
) -> None:
    fd = lingering.detach()
    close_fds([fd])  # returns at once: the closer thread closes it
    # Its table entry goes at once either way; a close that waited out the linger
    # would hold the closer, and the next descriptor would wait behind it.
    r, w = os.pipe()
    close_fds([r])
    wait_closed(r)
    os.close(w)


def test_descriptors_queued_in_a_unix_socket_are_read_out_and_closed_without_linger(
    lingering: socket.socket,
) -> None:
    """A peer's connection (or a unix socket it sent) may still hold descriptors in
    its queue; closing it releases them as it is closed, their linger included. The
    closer reads them out first, nested unix sockets too, and closes each without."""
    outer_a, outer_b = socket.socketpair()
    inner_a, inner_b = socket.socketpair()
    rights = socket.SCM_RIGHTS
    inner_a.sendmsg([b"x"], [(socket.SOL_SOCKET, rights, array.array("i", [lingering.fileno()]))])
    outer_a.sendmsg([b"y"], [(socket.SOL_SOCKET, rights, array.array("i", [inner_b.fileno()]))])
    for s in (lingering, inner_a, inner_b):
        s.close()  # the queues hold the last references now
    close_fds([outer_b.detach()])
    r, w = os.pipe()
    close_fds([r])  # closed once the closer is past the socket above
    wait_closed(r)
    os.close(w)
    outer_a.close()


def test_descriptors_of_every_kind_are_closed() -> None:
    r, w = os.pipe()
    memfd = os.memfd_create("closer-test")
    close_fds([r, w, memfd, 1 << 20])  # the last is not open: skipped
    for fd in (r, w, memfd):
        wait_closed(fd)
