"""``make bench-engine``'s clock for the kvoffload engine's batch interval: it runs only
while the engine's own blocks do, so an engine taking turns with two others writes
once per interval of its own steps (not at every block's first step, untimed)."""

from __future__ import annotations

import pytest

from kvoffloadbench.engine_step import OwnClock


class Wall:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_engines_clock_stands_still_between_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wall = Wall()
    monkeypatch.setattr("kvoffloadbench.engine_step.time.monotonic", wall)
    own = OwnClock()
    assert own() == 100.0
    wall.now_s = 105.0  # its block
    own.stop()
    wall.now_s = 125.0  # the other engines' blocks: time that is not its own
    assert own() == 105.0
    own.stop()  # stopping again changes nothing
    wall.now_s = 130.0
    assert own() == 105.0
    own.go()  # its next block: on from where it stood
    assert own() == 105.0
    wall.now_s = 131.0
    assert own() == 106.0
    own.go()  # going again changes nothing
    assert own() == 106.0
