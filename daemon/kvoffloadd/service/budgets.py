"""Global budgets: no client, or set of clients, can exhaust what all of them share
(DESIGN.md invariant 11). The loop owns one ``Budgets`` and asks it before it lets a
connection take more.

- Descriptors. The daemon raises its soft limit to the hard one at start and keeps a
  reserve descriptor: at EMFILE it frees the reserve, accepts the newest connection
  and closes it at once (shed), so the loop never dies of ``accept``. Connections
  are capped at ``max_clients`` and at what the limit leaves after a reserve.
  Descriptors a client parks with SCM_RIGHTS count against it (``FDS_PER_CLIENT``)
  and against ``fd_budget`` for all clients together.
- Memory. Request bytes buffered for frames not yet complete, and reply bytes not yet
  sent, count per connection and for all together. A connection over its own limit,
  or the largest holder when the total is over ``buffer_budget_bytes``, is cut off.
- Loop time. A connection gets at most ``FRAMES_PER_TURN`` requests, or its slice
  of the loop's time, dispatched per loop turn, and none while it has more than
  ``PAUSE_OUTPUT_BYTES`` of replies unsent (it must read first). The slice is
  ``TURN_S`` shared among the connections with work this turn (never below
  ``MIN_SLICE_S``; the first frame always goes), so a turn stays near ``TURN_S``
  however many clients are busy, and no client holds the loop for the others.

Pure bookkeeping on the loop thread; the server acts on its answers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

FDS_PER_CLIENT = 256  # AttachWorker of a rank with this many memfd caches at most
FRAMES_PER_TURN = 64
TURN_S = 0.010  # loop time shared by the connections with work, per turn
MIN_SLICE_S = 0.0002


def slice_s(busy_connections: int) -> float:
    """One connection's share of a loop turn."""
    return max(MIN_SLICE_S, TURN_S / max(1, busy_connections))


PAUSE_OUTPUT_BYTES = 1 << 20
MAX_OUTPUT_BYTES_PER_CLIENT = 32 << 20
FD_RESERVE = 64  # for the region, tiers, metrics, logs and the shedding itself
TRIM_AFTER_BYTES = 32 << 20


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
    buffered_input_bytes: int
    buffered_output_bytes: int
    parked_fds: int
    fd_limit: int


class Budgets:
    def __init__(self, max_clients: int, buffer_budget_bytes: int, fd_limit: int) -> None:
        self.fd_limit = fd_limit
        room = max(8, fd_limit - FD_RESERVE)
        # each client: its socket, plus a share of the parked-descriptor budget
        self.max_clients = max(1, min(max_clients, room // 2))
        self.fd_budget = max(FDS_PER_CLIENT, room - self.max_clients)
        self.buffer_budget_bytes = buffer_budget_bytes
        self.input_bytes = 0
        self.output_bytes = 0
        self.parked_fds = 0
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
            conn.close()
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

    def fds_ok(self, client_fds: int) -> bool:
        return client_fds <= FDS_PER_CLIENT and self.parked_fds <= self.fd_budget

    def memory_over(self) -> bool:
        return self.input_bytes + self.output_bytes > self.buffer_budget_bytes

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            clients_shed_total=self.shed_total,
            clients_cut_off_total=self.cut_off_total,
            buffered_input_bytes=self.input_bytes,
            buffered_output_bytes=self.output_bytes,
            parked_fds=self.parked_fds,
            fd_limit=self.fd_limit,
        )
