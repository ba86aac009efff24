"""Forked helper processes of the hostile tests, and the tagged messages they send back.

A message is a one-byte tag, an 8-byte length and a payload, over a pipe. A child is
forked (``fork``: it never returns into the test) and ``reap``-ed, or killed, whatever
the test does.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import struct
import time
from collections.abc import Callable


def send(fd: int, tag: bytes, payload: bytes = b"") -> None:
    data = tag + struct.pack("<Q", len(payload)) + payload
    while data:
        data = data[os.write(fd, data) :]


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("the child did not answer in time")
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the child went away without a word")
        out += chunk
    return out


def receive(fd: int, deadline: float) -> tuple[bytes, bytes]:
    """The next message: its tag and payload (``TimeoutError`` past ``deadline``)."""
    head = _read_exactly(fd, 9, deadline)
    (n,) = struct.unpack("<Q", head[1:])
    return head[:1], _read_exactly(fd, n, deadline)


def fork(child: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:  # never returns into the test
        try:
            child()
        finally:
            os._exit(0)
    return pid


def reap(pid: int, deadline_s: float = 5.0) -> None:
    """Wait for a child for ``deadline_s``, then kill it."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
