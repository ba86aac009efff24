"""What the edge needs beyond the ledger: descriptors for itself, shedding, the loop's time.

What each connection holds (its connection, buffered bytes, parked descriptors) is in
the ledger (``kvoffloadd.ledger``); the server charges it there and cuts off whoever is
over a limit. This module keeps what is not anyone's holding:

- Descriptors. The daemon raises its soft limit to the hard one at start and keeps a
  reserve descriptor: at EMFILE it frees the reserve, accepts the newest connection
  and closes it at once (shed), so the loop never dies of ``accept``. Connections are
  capped at ``max_clients`` and at what the limit leaves after a reserve; descriptors
  peers make the daemon hold at what is left after that (``fd_budget``). The process's
  descriptor table is grown to the limit at start (``size_fd_table``): the kernel grows
  it by doubling as descriptors arrive, and in a process with threads each doubling
  waits for an RCU grace period (20-30 ms each on a 2-vCPU VM), on the loop thread,
  inside the ``recvmsg`` or ``accept`` that crossed it. The table costs 8 bytes per
  descriptor (4 MiB at systemd's 524,288).
- Loop time. Connections with work are served one unit at a time, fairly by the loop
  time each used (``kvoffloadd.server.turns``); a turn serves ``TURN_S`` of work in
  total (past it, the unit in progress and at most one queued unit), whoever the
  connections are, requests served as they are read included, and none for a
  connection with more than ``PAUSE_OUTPUT_BYTES`` of replies unsent (it must read
  first).
- Memory given back: after large buffers went away the heap is trimmed.

Pure bookkeeping on the loop thread; the server acts on its answers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvoffloadd.copies.closer import close_now

TURN_S = 0.010  # loop time one turn dispatches, all connections together
PAUSE_OUTPUT_BYTES = 1 << 20
MAX_OUTPUT_BYTES_PER_CLIENT = 32 << 20
FD_RESERVE = 64  # for the region, tiers, metrics, logs and the shedding itself
TRIM_AFTER_BYTES = 32 << 20
FD_TABLE_MAX = 1 << 20  # the kernel's default fs.nr_open: no table grows past it


def size_fd_table(fd_limit: int) -> None:
    """Grow the descriptor table to hold ``fd_limit`` descriptors now, once (it never
    shrinks), by duplicating a descriptor to the highest number and closing it."""
    top = min(fd_limit, FD_TABLE_MAX) - 1
    if top < 64:  # within the table every process starts with
        return
    fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.dup2(fd, top, inheritable=False)
        os.close(top)
    except OSError:
        pass  # the limit was lowered under us: the table grows as it would have
    finally:
        os.close(fd)


def _libc_trim() -> object:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim: Any = _libc_trim()


@dataclass
class BudgetStatistics:
    clients_shed_total: int
    clients_cut_off_total: int
    fd_limit: int
    fd_budget: int
    max_clients: int


class Budgets:
    def __init__(self, max_clients: int, fd_limit: int) -> None:
        self.fd_limit = fd_limit
        size_fd_table(fd_limit)
        room = max(8, fd_limit - FD_RESERVE)
        # each client: its socket, plus a share of the held-descriptor budget
        self.max_clients = max(1, min(max_clients, room // 2))
        self.fd_budget = max(256, room - self.max_clients)
        self.shed_total = 0
        self.cut_off_total = 0
        self.released_bytes = 0  # buffers given back since the last trim
        self._reserve = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def shed(self, accept_one: object) -> None:
        """At EMFILE: free the reserve, take the newest connection and close it."""
        import socket as _socket

        os.close(self._reserve)
        try:
            assert isinstance(accept_one, _socket.socket)
            conn, _ = accept_one.accept()
            # Here and now, so the reserve can be taken again (the descriptor table is
            # full): its linger off and what it queued read out first (closer.py).
            close_now(conn.detach())
            self.shed_total += 1
        except OSError:
            pass
        finally:
            self._reserve = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        os.close(self._reserve)

    def trim(self) -> None:
        """After large buffers went away, hand the memory back to the system."""
        if self.released_bytes < TRIM_AFTER_BYTES:
            return
        self.released_bytes = 0
        if _malloc_trim is not None:
            _malloc_trim(0)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            clients_shed_total=self.shed_total,
            clients_cut_off_total=self.cut_off_total,
            fd_limit=self.fd_limit,
            fd_budget=self.fd_budget,
            max_clients=self.max_clients,
        )
