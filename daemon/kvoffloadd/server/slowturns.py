"""A loop turn that took long, told in one log line with what it did.

Another client waits behind a turn (DESIGN.md invariant 15: under 100 ms), so a turn of
``SLOW_TURN_S`` or more is worth an operator's look, and the line says where its time
went: reading ready connections, serving queued units (how many, the longest and whose,
and how much of that time the loop thread was on a CPU: far less than the wall time
means the machine, not the daemon's work, held the loop), pushing feeds.
``kvoffload_loop_turn_seconds`` counts such turns; the line says why one was slow.

Rules:
- Costs the loop nothing until a turn is slow: the loop keeps its turn's figures
  anyway (``ServePhase`` is filled once per turn that serves), and reads the thread's
  CPU clock only for a slow turn.
- At most one line per ``LOG_GAP_S``: a peer that keeps turns long cannot flood the log
  (the loop formats each line, and the log writer's queue is shared by every line); the
  turns not told are counted in the next line.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SLOW_TURN_S = 0.050  # half what another client may wait for a round trip
LOG_GAP_S = 1.0


@dataclass(slots=True)
class ServePhase:
    """What a turn's serving of queued units did (set by the loop once per turn)."""

    units: int = 0
    started_s: float = 0.0  # on the loop's clock
    started_cpu_s: float = 0.0  # the loop thread's CPU clock when it started
    longest_s: float = 0.0  # the longest unit, wall time
    longest_of: int = -1  # its connection (the loop's id), or the reaper's


class SlowTurns:
    """Tells slow turns, one line per ``LOG_GAP_S`` at most."""

    def __init__(
        self,
        describe: Callable[[int], str],
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self._describe = describe  # a connection's id -> "client 5 (pid 1 uid 2)"
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._told_at_s = -math.inf
        self._untold = 0
        self.total = 0

    def turn(
        self,
        spent_s: float,
        ready: int,
        reads_s: float,
        serve: ServePhase | None,
        ended_s: float,
    ) -> None:
        """A turn took ``spent_s`` (over ``SLOW_TURN_S``): ``ready`` descriptors handled
        in ``reads_s``, then ``serve`` (None: nothing queued was served), ending at
        ``ended_s`` on the loop's clock."""
        self.total += 1
        now_s = self._clock()
        if now_s - self._told_at_s < LOG_GAP_S:
            self._untold += 1
            return
        parts = [
            f"loop turn took {spent_s * 1e3:.1f} ms",
            f"{ready} ready descriptors handled in {reads_s * 1e3:.1f} ms",
        ]
        if serve is not None and serve.units:
            cpu_s = self._cpu_clock() - serve.started_cpu_s
            parts.append(
                f"{serve.units} queued units served in {(ended_s - serve.started_s) * 1e3:.1f}"
                f" ms, the loop thread on a CPU {cpu_s * 1e3:.1f} ms of it"
            )
            parts.append(
                f"longest {serve.longest_s * 1e3:.1f} ms, {self._describe(serve.longest_of)}"
            )
        if self._untold:
            parts.append(f"{self._untold} more slow turns since the last such line")
        log.warning("; ".join(parts))
        self._told_at_s, self._untold = now_s, 0
