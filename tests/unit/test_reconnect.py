"""The client's keeper, against a scripted daemon: how often it tries to reconnect while
the daemon is away, and that a daemon which comes back is found at once. Its waits are
recorded, never slept; no sockets."""

from __future__ import annotations

from typing import Any

import kvoffload
from kvoffload.client import _Link
from kvoffload.protocol.errors import DaemonUnavailableError, NotFoundError


class _Transport:
    def close(self) -> None:
        pass


class ScriptedKeeper(kvoffload.Client):
    """A client whose handshakes follow ``script`` ("down": the daemon is away,
    "missing": it is up but the namespace is not yet, "up": it answers) and whose
    keeper records each wait instead of sleeping; the engine adopts each new
    connection at the keeper's next wait, and the connection drops again at once."""

    def __init__(self, script: list[str]) -> None:
        super().__init__("kvoffloadd.sock")
        self.script = script
        self.waits: list[float | None] = []
        self.handshakes = 0

    def _handshake(self) -> _Link:
        self.handshakes += 1
        what = self.script.pop(0)
        if not self.script:
            self._closed = True  # the script is over: the keeper leaves after this
        if what == "down":
            raise DaemonUnavailableError("kvoffloadd is not there")
        if what == "missing":
            raise NotFoundError("namespace 'v' is not open yet")
        return _Link(_Transport(), None)  # type: ignore[arg-type]

    def _wait(self, timeout_s: float | None, fd: int = -1) -> bool:
        self.waits.append(timeout_s)
        self._pending = None  # adopted, and lost again
        return False


def keeper(script: list[str]) -> ScriptedKeeper:
    c = ScriptedKeeper(script)
    c._keep_until_closed()
    c._closed = False
    c.close()
    return c


def test_retries_back_off_from_the_first_delay_to_the_cap_and_no_further() -> None:
    c = keeper(["down"] * 12)
    lo, hi = kvoffload.Client.RETRY_MIN_S, kvoffload.Client.RETRY_MAX_S
    expected: list[Any] = []
    delay = lo
    for _ in range(12):
        expected.append(delay)
        delay = min(2 * delay, hi)
    assert c.waits == expected
    assert max(c.waits) == hi  # type: ignore[type-var]


def test_a_daemon_that_comes_back_is_tried_again_from_the_first_delay() -> None:
    c = keeper(["down"] * 8 + ["up"] + ["down"] * 3)
    lo, hi = kvoffload.Client.RETRY_MIN_S, kvoffload.Client.RETRY_MAX_S
    assert c.waits[:8] == [lo, 2 * lo, 4 * lo, 8 * lo, hi, hi, hi, hi]
    assert c.waits[8] == 1.0  # connected: waits for the engine to adopt it
    assert c.waits[9:] == [lo, 2 * lo, 4 * lo]  # lost again: the backoff starts over
    assert c.handshakes == 12


def test_a_namespace_not_open_yet_is_waited_for_like_an_absent_daemon() -> None:
    c = keeper(["missing"] * 3 + ["up"])
    lo = kvoffload.Client.RETRY_MIN_S
    assert c.waits == [lo, 2 * lo, 4 * lo]
