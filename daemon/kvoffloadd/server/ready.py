"""Ready connections shared out among their uids when more are ready than a turn reads.

Rules:
- A turn reads at most ``READY_PER_TURN`` connections. When epoll reports that many,
  up to ``MAX_READY`` more are taken from it, and this turn gets every watched
  descriptor (listener, wake-ups, signals, timers: never held back) and
  ``READY_PER_TURN`` connections shared out among their uids, each uid's longest
  ready first; the rest wait, per uid, for the next turns. epoll alone goes round
  every ready descriptor in turn: 1,000 connections of one uid ready at once held
  another uid's ping behind all 1,000 reads.
- A connection's events that come while it waits are merged into its entry; one
  dropped meanwhile is ``forget``-ten and skipped.
- O(descriptors polled + uids waiting) a turn. Loop thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

READY_PER_TURN = 256  # descriptors one turn handles, shared out among uids past it
MAX_READY = 2048  # ready descriptors taken from epoll at once when more than a turn's


class ReadyShare:
    """Connections that were ready and no turn has read yet."""

    def __init__(self, poll_more: Callable[[int], list[tuple[int, int]]]) -> None:
        self._poll_more = poll_more  # up to n more (fd, events) at once, not waiting
        self.pending: dict[int, int] = {}  # fd -> its events, merged while it waits
        self._waiting: dict[int, deque[int]] = {}  # uid -> its fds in the order they came

    def forget(self, fd: int) -> None:
        """``fd``'s connection was dropped: its entry is skipped."""
        self.pending.pop(fd, None)

    def share(
        self, ready: list[tuple[int, int]], uid_of: Callable[[int], int | None]
    ) -> list[tuple[int, int]]:
        """What this turn handles of ``ready`` (what epoll gave it) and of those still
        waiting; ``uid_of(fd)`` is a connection's uid, None for a watched descriptor."""
        pending, waiting = self.pending, self._waiting
        if len(ready) == READY_PER_TURN:
            ready += self._poll_more(MAX_READY)
        watched: dict[int, int] = {}
        for fd, events in ready:
            uid = uid_of(fd)
            if uid is None:
                watched[fd] = watched.get(fd, 0) | events
            elif fd in pending:
                pending[fd] |= events
            else:
                pending[fd] = events
                q = waiting.get(uid)
                if q is None:
                    waiting[uid] = q = deque()
                q.append(fd)
        out = list(watched.items())
        room = READY_PER_TURN
        while room > 0 and waiting:
            share = max(1, room // len(waiting))
            for uid in list(waiting):
                q = waiting.pop(uid)
                taken = 0
                while q and taken < share:
                    fd = q.popleft()
                    events = pending.pop(fd, 0)
                    if events:  # else it was dropped since
                        out.append((fd, events))
                        taken += 1
                room -= taken
                if q:
                    waiting[uid] = q  # behind the others for what is left
                if room <= 0:
                    break
        if not pending:
            waiting.clear()  # what is left in it left the loop
        return out
