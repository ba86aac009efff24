"""TierProbes: what a vLLM lookup answers for keys the key mirror misses when the
daemon has secondary tiers (one round trip per cold key, batches per request)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvoffload.engine.tierprobe import TierProbes
from kvoffload.engine.view import KeyState
from kvoffload.protocol.messages import KEY_ABSENT, KEY_PROMOTING, KEY_READY


class FakeDaemon:
    """Answers probes from ``where`` (key -> state); records each call's keys."""

    def __init__(self) -> None:
        self.where: dict[bytes, int] = {}
        self.calls: list[list[bytes]] = []

    def probe(self, keys: Sequence[bytes]) -> list[int]:
        self.calls.append(list(keys))
        out = []
        for k in keys:
            out.append(self.where.get(k, KEY_ABSENT))
            if out[-1] == KEY_ABSENT:
                break
        return out


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def make() -> tuple[TierProbes, FakeDaemon, Clock]:
    daemon, clock = FakeDaemon(), Clock()
    return TierProbes(cast(Any, daemon), absent_s=1.0, promoting_s=5.0, clock=clock), daemon, clock


def test_a_cold_key_misses_after_one_round_trip_and_is_remembered() -> None:
    probes, daemon, clock = make()
    assert probes.lookup(b"k", "r1") is KeyState.MISS
    assert probes.lookup(b"k", "r2") is KeyState.MISS  # remembered: no second trip
    assert daemon.calls == [[b"k"]]
    clock.now = 1.5
    assert probes.lookup(b"k", "r3") is KeyState.MISS
    assert len(daemon.calls) == 2  # forgotten after absent_s


def test_a_tier_hit_retries_and_the_rest_of_the_request_goes_in_one_batch() -> None:
    probes, daemon, _ = make()
    daemon.where = {b"a": KEY_PROMOTING, b"b": KEY_PROMOTING, b"c": KEY_PROMOTING}
    answers = [probes.lookup(k, "r") for k in (b"a", b"b", b"c", b"d")]
    assert answers == [KeyState.RETRY] * 4  # vLLM keeps scanning after RETRY
    assert daemon.calls == [[b"a"]]
    probes.end_step()
    assert daemon.calls[-1] == [b"a", b"b", b"c", b"d"]  # one batch: promotes b and c
    # next step: still promoting -> RETRY; d was found absent -> MISS
    daemon.where = {b"a": KEY_READY, b"b": KEY_READY, b"c": KEY_PROMOTING}
    assert probes.lookup(b"d", "r") is KeyState.MISS
    assert probes.lookup(b"c", "r") is KeyState.RETRY
    probes.end_step()
    daemon.where[b"c"] = KEY_READY
    assert probes.lookup(b"c", "r") is KeyState.RETRY  # remembered until the step's probe
    probes.end_step()
    assert probes.lookup(b"c", "r") is KeyState.HIT  # the mirror lagging: daemon says ready


def test_another_request_in_the_same_step_is_probed_on_its_own() -> None:
    probes, daemon, _ = make()
    daemon.where = {b"a": KEY_PROMOTING}
    assert probes.lookup(b"a", "r1") is KeyState.RETRY
    assert probes.lookup(b"x", "r2") is KeyState.MISS  # a cold request is not held back
    assert daemon.calls == [[b"a"], [b"x"]]


def test_a_failed_promotion_comes_back_absent() -> None:
    probes, daemon, _ = make()
    daemon.where = {b"a": KEY_PROMOTING}
    assert probes.lookup(b"a", "r") is KeyState.RETRY
    daemon.where = {}  # the tier lost it: the daemon's promotion failed
    probes.end_step()
    assert probes.lookup(b"a", "r") is KeyState.MISS


def test_an_unreachable_daemon_means_miss() -> None:
    probes, daemon, _ = make()
    daemon.probe = lambda keys: []  # type: ignore[method-assign]
    assert probes.lookup(b"a", "r") is KeyState.MISS
