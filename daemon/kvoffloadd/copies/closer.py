"""Closing the descriptors peers sent, never on the loop thread.

Rules:
- Closing the last reference to a file runs its release where it is closed: a TCP
  socket with ``SO_LINGER`` waits out its linger time (the kernel allows years), a
  FUSE file waits for its server. A peer chooses what it sends, so nothing a peer sent
  is closed on the loop: ``close_fds`` hands the descriptors to one closer thread and
  returns at once.
- The closer switches a socket's linger off before closing it, so a socket's close
  never waits. A unix socket's queue may carry descriptors (a peer's connection, a
  socket it sent): they are read out and closed the same way first, to a depth of
  ``MAX_DEPTH``. A file whose server stalls (FUSE), or sockets nested deeper, can
  hold the closer, never the loop.
- The daemon's own descriptors (``close_own_fds``) are closed where they are done
  with: they never wait behind a peer's.
- The descriptor table is the limit on what waits to be closed: the ledger charges a
  connection's descriptors until it hands them here (``descriptors``).
- The closer is a daemon thread, started at the first use; what is still queued at
  exit is closed by the process's exit, where no linger applies.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import queue
import socket
import struct
import threading

log = logging.getLogger(__name__)

_NO_LINGER = struct.pack("ii", 0, 0)
MAX_DEPTH = 4  # unix sockets inside unix sockets read out before closing
MAX_DRAIN_READS = 256  # reads of one socket's queue before it is closed as it is
DRAIN_BYTES = 64 * 1024
_ANC_BYTES = socket.CMSG_SPACE(253 * 4)  # SCM_MAX_FD descriptors: none left behind

_queue: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None


def close_fds(fds: list[int]) -> None:
    """Close these descriptors soon, on the closer thread (any thread may call)."""
    if not fds:
        return
    global _thread
    if _thread is None:
        with _started:
            if _thread is None:
                _thread = threading.Thread(target=_close_all, name="kvoffload-closer", daemon=True)
                _thread.start()
    _queue.put(list(fds))


def received_fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors SCM_RIGHTS brought with a ``recvmsg`` (its ancillary data)."""
    out: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            out.extend(fds)
    return out


def close_own_fds(fds: list[int]) -> None:
    """Close descriptors the daemon made itself, here and now (no peer chose them)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def close_now(fd: int, depth: int = 0) -> None:
    """Close one descriptor on this thread: a socket's linger off first, and what a
    unix socket still holds read out and closed the same way first (its queue may
    carry descriptors, which the kernel would otherwise release with their linger)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        with contextlib.suppress(OSError):
            os.close(fd)
        return
    if sock.family == socket.AF_UNIX and depth < MAX_DEPTH:
        _drain(sock, depth)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    sock.close()


def _drain(sock: socket.socket, depth: int) -> None:
    """Read what a unix socket holds (at most ``MAX_DRAIN_READS`` reads) and close
    the descriptors that came with it."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
    for _ in range(MAX_DRAIN_READS):
        try:
            data, anc, _flags, _ = sock.recvmsg(DRAIN_BYTES, _ANC_BYTES)
        except OSError:  # nothing more now, not connected, or not readable
            return
        for received in received_fds(anc):
            close_now(received, depth + 1)
        if not data and not anc:  # the end of the stream
            return


def _close_all() -> None:
    while True:
        for fd in _queue.get():
            try:
                close_now(fd)
            except Exception:  # the closer must outlive any one descriptor
                log.exception("closing descriptor %d failed", fd)
