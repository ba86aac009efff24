"""Closing the descriptors peers sent, never on the loop thread.

Rules:
- Closing the last reference to a file runs its release where it is closed: a TCP
  socket with ``SO_LINGER`` waits out its linger time (the kernel allows years), a
  FUSE file waits for its server. A peer chooses what it sends, so nothing a peer sent
  is closed on the loop: ``close_fds`` hands the descriptors to one closer thread and
  returns at once.
- The closer switches a socket's linger off before closing it, so a socket's close
  never waits; only a file whose server stalls (FUSE) can hold the closer, never the
  loop.
- The descriptor table is the limit on what waits to be closed: the ledger charges a
  connection's descriptors until it hands them here (``descriptors``).
- The closer is a daemon thread, started at the first use; what is still queued at
  exit is closed by the process's exit, where no linger applies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading

log = logging.getLogger(__name__)

_NO_LINGER = struct.pack("ii", 0, 0)

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


def close_now(fd: int) -> None:
    """Close one descriptor on this thread; a socket's linger off first."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        with contextlib.suppress(OSError):
            os.close(fd)
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    sock.close()


def _close_all() -> None:
    while True:
        for fd in _queue.get():
            try:
                close_now(fd)
            except Exception:  # the closer must outlive any one descriptor
                log.exception("closing descriptor %d failed", fd)
