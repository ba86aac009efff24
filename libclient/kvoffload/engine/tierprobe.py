"""Lookups past the key mirror, for a daemon with secondary tiers below its region.

The key mirror (mirror.py) knows the region's keys only. A key it misses may still be
on a disk or in Redis below the daemon; the daemon can promote it into the region, and
vLLM's scheduler is built for that: a lookup answers RETRY ("ask again next step") and
the scan goes on, so the manager can start promotions for the keys that follow.

Rules:
- A key the mirror misses is probed once with one round trip (``Namespace.probe``):
  ABSENT answers MISS, at once, so a cold prompt costs no extra scheduler step; READY
  (the mirror is a moment behind) answers HIT; PROMOTING answers RETRY.
- After a RETRY, the same request's further keys are not probed one by one: they
  answer RETRY and are probed together at the end of the step (``end_step``), which
  starts their promotions as one batch per tier in the daemon.
- Answers are remembered: ABSENT for ``absent_s`` (a key stored meanwhile by any
  engine is a mirror HIT first anyway), PROMOTING until the next probe of that key,
  for at most ``promoting_s``. A promotion that failed comes back ABSENT.
- Not thread-safe: the owner serialises calls (vLLM holds ``manager.lock``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from kvoffload.engine.view import KeyState
from kvoffload.namespace import Namespace
from kvoffload.protocol.messages import KEY_ABSENT, KEY_PROMOTING, KEY_READY

MAX_REMEMBERED = 1 << 17


class TierProbes:
    def __init__(
        self,
        ns: Namespace,
        absent_s: float = 1.0,
        promoting_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ns = ns
        self.absent_s = absent_s
        self.promoting_s = promoting_s
        self._clock = clock
        self._known: dict[bytes, tuple[int, float]] = {}  # key -> (state, valid until)
        self._deferred: dict[Hashable, dict[bytes, None]] = {}  # request -> keys, in order
        self.probes_total = 0  # round trips

    def lookup(self, key: bytes, request: Hashable) -> KeyState:
        """The answer for a key the mirror missed."""
        known = self._known.get(key)
        if known is not None and known[1] > self._clock():
            if known[0] == KEY_ABSENT:
                return KeyState.MISS
            return self._defer(request, key)
        if request in self._deferred:
            return self._defer(request, key)
        self.probes_total += 1
        states = self.ns.probe([key])
        state = states[0] if states else KEY_ABSENT
        if state == KEY_READY:
            self._known.pop(key, None)
            return KeyState.HIT
        self._remember(key, state)
        return self._defer(request, key) if state == KEY_PROMOTING else KeyState.MISS

    def end_step(self) -> None:
        """Probe the keys answered RETRY this step, one call per request."""
        deferred, self._deferred = self._deferred, {}
        for keys in deferred.values():
            ordered = list(keys)
            self.probes_total += 1
            states = self.ns.probe(ordered)
            for i, key in enumerate(ordered):
                if i < len(states) and states[i] != KEY_READY:
                    self._remember(key, states[i])
                else:
                    self._known.pop(key, None)  # ready, or behind the first absent key

    def forget(self) -> None:
        self._known.clear()
        self._deferred.clear()

    def _defer(self, request: Hashable, key: bytes) -> KeyState:
        self._deferred.setdefault(request, {})[key] = None
        return KeyState.RETRY

    def _remember(self, key: bytes, state: int) -> None:
        now = self._clock()
        if len(self._known) >= MAX_REMEMBERED:
            self._known = {k: v for k, v in self._known.items() if v[1] > now}
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
        ttl = self.absent_s if state == KEY_ABSENT else self.promoting_s
        self._known[key] = (state, now + ttl)
