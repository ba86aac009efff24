"""The loop's own figures in stats: turn lengths, and the frozen start-up objects."""

from __future__ import annotations

import gc

import pytest

from kvoffloadd.service.stats import LoopTurns


def test_turns_give_percentiles_and_the_longest() -> None:
    turns = LoopTurns()
    for us in range(1, 101):
        turns.record(us / 1e6)
    s = turns.summary()
    assert s["turns_total"] == 100 and s["turn_max_us"] == 100.0
    assert s["turn_p50_us"] == 51.0 and s["turn_p99_us"] == 100.0


def test_a_stats_call_never_walks_the_frozen_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """gc.get_freeze_count() walks every frozen object (a stats call took 407 us with
    it, 62 without): main() counts them once, the summary only reports the count."""

    def walked() -> int:
        raise AssertionError("a stats call walked the frozen objects")

    monkeypatch.setattr(gc, "get_freeze_count", walked)
    turns = LoopTurns()
    turns.frozen_objects = 32_000
    assert turns.summary()["gc_frozen_objects"] == 32_000
