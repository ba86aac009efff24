"""The client's keeper, against a scripted daemon: how often it tries to reconnect while
the daemon is away, and that a daemon which comes back is found at once. Its waits are
recorded, never slept; no sockets."""

from __future__ import annotations

import threading
from typing import Any

from kvoffload.link.keeper import Keeper, Link
from kvoffload.link.transport import Transport
from kvoffload.protocol.errors import DaemonUnavailableError, NotFoundError


class _Transport:
    def close(self) -> None:
        pass


class ScriptedClient:
    """A client (``Kept``) whose handshakes follow ``script`` ("down": the daemon is
    away, "missing": it is up but the namespace is not yet, "up": it answers); the
    engine adopts each new connection at the keeper's next wait, and the connection
    drops again at once."""

    socket_path = "kvoffloadd.sock"

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.handshakes = 0
        self.pending = False
        self.closed = False

    def watched(self) -> tuple[Transport | None, bool]:
        return None, self.pending

    def handshake(self) -> Link:
        self.handshakes += 1
        what = self.script.pop(0)
        if not self.script:
            self.closed = True  # the script is over: the keeper leaves after this
        if what == "down":
            raise DaemonUnavailableError("kvoffloadd is not there")
        if what == "missing":
            raise NotFoundError("namespace 'v' is not open yet")
        return Link(_Transport(), None)  # type: ignore[arg-type]

    def hung_up(self, t: Transport) -> None:
        raise AssertionError("never connected")

    def offer(self, link: Link) -> bool:
        self.pending = True
        return True


class RecordingKeeper(Keeper):
    """A keeper that records each wait instead of sleeping."""

    def __init__(self, client: ScriptedClient) -> None:
        super().__init__(client, threading.RLock())
        self.scripted = client
        self.waits: list[float | None] = []

    def wait(self, timeout_s: float | None, fd: int = -1) -> bool:
        self.waits.append(timeout_s)
        self.scripted.pending = False  # adopted, and lost again
        return False


def keeper(script: list[str]) -> RecordingKeeper:
    c = RecordingKeeper(ScriptedClient(script))
    c.keep_until_closed()
    assert c.stop() is None  # no thread ran: the eventfd closes here
    return c


def test_retries_back_off_from_the_first_delay_to_the_cap_and_no_further() -> None:
    c = keeper(["down"] * 12)
    lo, hi = Keeper.RETRY_MIN_S, Keeper.RETRY_MAX_S
    expected: list[Any] = []
    delay = lo
    for _ in range(12):
        expected.append(delay)
        delay = min(2 * delay, hi)
    assert c.waits == expected
    assert max(c.waits) == hi  # type: ignore[type-var]


def test_a_daemon_that_comes_back_is_tried_again_from_the_first_delay() -> None:
    c = keeper(["down"] * 8 + ["up"] + ["down"] * 3)
    lo, hi = Keeper.RETRY_MIN_S, Keeper.RETRY_MAX_S
    assert c.waits[:8] == [lo, 2 * lo, 4 * lo, 8 * lo, hi, hi, hi, hi]
    assert c.waits[8] == Keeper.ADOPT_WAIT_S  # connected: waits for the engine to adopt it
    assert c.waits[9:] == [lo, 2 * lo, 4 * lo]  # lost again: the backoff starts over
    assert c.scripted.handshakes == 12


def test_a_namespace_not_open_yet_is_waited_for_like_an_absent_daemon() -> None:
    c = keeper(["missing"] * 3 + ["up"])
    lo = Keeper.RETRY_MIN_S
    assert c.waits == [lo, 2 * lo, 4 * lo]


def test_a_fault_inside_the_keeper_does_not_end_its_keeping() -> None:
    """Anything that escapes the loop (here the first look at the connection, as when
    the process is out of descriptors) is logged and the keeper starts over, rather
    than leaving the client with no keeper and a closed wake-up descriptor."""

    class Faulty(ScriptedClient):
        looks = 0

        def watched(self) -> tuple[Transport | None, bool]:
            self.looks += 1
            if self.looks == 1:
                raise OSError(24, "Too many open files")
            return super().watched()

    c = RecordingKeeper(Faulty(["down", "up"]))
    c._run()  # on this thread: returns once the script is over
    assert c.waits == [Keeper.RETRY_REFUSED_S, Keeper.RETRY_MIN_S]
    assert c.scripted.handshakes == 2
