"""No kvoffloadd fault reaches a vLLM engine: vLLM 0.33's real Scheduler and
OffloadingConnector, both roles, in two engine processes, against a real daemon.

Engine A copies itself (vLLM's own CPU KV allocation: client-copy mode); engine B lets
the daemon copy (the same KV views over a memfd). Each test kills, stops or restarts
the daemon at one boundary of a step and then requires that every request finishes,
no step stalls, every block the engines count as computed holds exactly its bytes
(loads included: ``bad_blocks``), and the logs say one thing per outage.

Boundaries (docs/vllm.md, "What the engine sees when kvoffloadd fails"): after a store was
planned and before its deferred submit; during a store copy; after a load was planned
and before its submit; during a load copy; between completion and the next lookup;
while idle; SIGTERM; a warm and a cold restart; a daemon that never comes back; a
socket that disappears; and the one case that stops an engine.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from engine_proc import STEP_LIMIT_S, EngineProc

import kvoffload
from kvoffloadbench.launch import DaemonProcess, drop_kept_region

pytestmark = pytest.mark.integration

RUN = uuid.uuid4().hex[:8]
TMP = tempfile.mkdtemp(prefix="kvoffload-vllm-")
SOCK = os.path.join(TMP, "kvoffloadd.sock")
INSTANCE = f"vf{RUN}"
OPTIONS = {"store_timeout_s": 5.0, "load_wait_s": 5.0}
_rng = random.Random(20261123)


def prompt(blocks: int = 6) -> list[int]:
    return [_rng.randrange(1, 999) for _ in range(blocks * 16 + 5)]


def daemon(*args: str) -> DaemonProcess:
    return DaemonProcess(
        "64MiB",
        "--keep-region",
        "--log-level",
        "warning",
        *args,
        socket_path=SOCK,
        instance=INSTANCE,
    ).start()


def drop_region() -> None:
    drop_kept_region(SOCK, INSTANCE)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EngineProc, EngineProc]]:
    common: dict[str, Any] = {"spec": "kvoffload", "socket_path": SOCK, "num_blocks": 512}
    a = EngineProc(engine_id="a", extra=OPTIONS, **common)
    b = EngineProc(engine_id="b", memfd=True, extra=OPTIONS, **common)
    d = daemon()  # for the engines' start-up; each test starts its own
    try:
        a.ready(), b.ready()
        d.kill()
        yield a, b
    finally:
        a.close()
        b.close()
        if d.alive():
            d.kill()
        drop_region()


@pytest.fixture
def live(engines: tuple[EngineProc, EngineProc]) -> Iterator[DaemonProcess]:
    """A daemon both engines are connected to (the previous test's is gone)."""
    d = daemon()
    for e in engines:
        e.connected()
        e.stats()  # forget the logs of the previous test
    yield d
    if d.alive():
        d.kill()


def finish(e: EngineProc) -> dict[str, Any]:
    """Run every request to its end; the engine must never have seen a fault."""
    e.run()
    st = e.stats()
    assert st["unfinished"] == 0
    assert st["bad_blocks"] == 0, "a block held bytes other than its own"
    assert st["slowest_step_s"] < STEP_LIMIT_S, f"a step stalled: {st['slowest_step_s']} s"
    assert not [x for x in st["logs"] if "cannot store chunks" in x], "vLLM warned per step"
    return st


def stored(d: DaemonProcess) -> int:
    """Blocks the daemon holds (all namespaces)."""
    with kvoffload.connect(d.socket_path) as admin:
        return int(admin.stats()["blocks"]["used_blocks"])


def outages(st: dict[str, Any]) -> int:
    return sum("lost kvoffloadd" in line for line in st["logs"])


def step_until(e: EngineProc, what: str) -> dict[str, Any]:
    """Schedule steps until one plans ``what`` ("stores" or "loads"); not executed."""
    for _ in range(200):
        s = e.schedule()
        if s[what]:
            return s
        e.execute()
    raise AssertionError(f"no step planned {what}")


def plan_a_load(
    storer: EngineProc, loader: EngineProc, live: DaemonProcess, tag: str, tokens: int = 4
) -> None:
    """``storer`` stores a prompt; ``loader`` schedules it up to the step that plans its
    load (not executed)."""
    p = prompt()
    storer.add((f"{tag}-s", p, tokens))
    finish(storer)
    loader.sees(stored(live))
    loader.add((f"{tag}-l", p, tokens))
    step_until(loader, "loads")


def test_engines_share_the_pool_byte_identical(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    plan_a_load(a, b, live, "s", tokens=8)
    b.execute()
    st = finish(b)
    assert st["loads"] >= 1 and st["blocking_calls"] == 0


@pytest.mark.parametrize("storer", ["a", "b"])
def test_killed_after_a_store_was_planned_before_its_deferred_submit(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess, storer: str
) -> None:
    e = engines[0] if storer == "a" else engines[1]
    p = prompt()
    e.add(("ks", p, 8))
    step_until(e, "stores")
    live.kill()  # the store's submit comes at the start of the next step
    e.execute()
    st = finish(e)
    assert outages(st) == 2  # one line per connection (scheduler, worker), once
    if storer == "b":  # a daemon copy cannot happen; a client copy lands uncommitted
        assert st["stores_dropped"] >= 1


def test_killed_during_a_daemon_copy_of_a_store(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    b = engines[1]
    b.add(("kc", prompt(), 8))
    step_until(b, "stores")
    b.execute()
    b.schedule()  # this step's execute submits the deferred store
    os.kill(live.pid, signal.SIGSTOP)  # it arrives, and is never copied
    b.execute()
    live.kill()
    st = finish(b)
    assert st["stores_dropped"] >= 1


@pytest.mark.parametrize("loader", ["a", "b"])
def test_killed_after_a_load_was_planned_before_its_submit(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess, loader: str
) -> None:
    a, b = engines
    storer, e = (b, a) if loader == "a" else (a, b)
    plan_a_load(storer, e, live, "ls")
    live.kill()
    e.execute()
    st = finish(e)
    assert st["loads"] >= 1  # completed from the region, byte-exact (bad_blocks == 0)


def test_killed_during_a_daemon_copy_of_a_load(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    plan_a_load(a, b, live, "lc")
    os.kill(live.pid, signal.SIGSTOP)
    b.execute()  # the load is submitted to a daemon that will never copy it
    live.kill()
    st = finish(b)
    assert st["loads"] >= 1 and st["loads_recovered"] >= 1


def test_killed_between_a_completion_and_the_next_lookup(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    p = prompt()
    a.add(("cl-s", p, 4))
    finish(a)
    b.sees(stored(live))
    live.kill()
    # b still plans the load from what its view knew; it completes from the region
    b.add(("cl-l", p, 4))
    assert finish(b)["loads"] >= 1
    # and a request with nothing cached is scheduled in its first step, no waiting
    b.add(("cl-new", prompt(), 4))
    assert b.schedule()["scheduled"].get("cl-new"), "a request waited on a daemon that is down"
    b.execute()
    finish(b)


def test_an_idle_outage_and_a_warm_restart_keep_every_stored_block(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    p = prompt()
    a.add(("iw-s", p, 4))
    finish(a)
    held = stored(live)
    live.kill()  # both engines idle; the region stays
    d2 = daemon()
    b.connected()
    b.sees(held)
    b.add(("iw-l", p, 4))
    first = b.schedule()
    assert first["loads"] == 1, "the warm restart lost the committed blocks"
    b.execute()
    st = finish(b)
    assert outages(st) == 2 and sum("resumes" in x for x in st["logs"]) == 2, st["logs"]
    d2.kill()


@pytest.mark.parametrize("warm", [True, False])
def test_after_a_quiet_outage_the_very_next_request_is_offloaded(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess, warm: bool
) -> None:
    """Both engines idle while the daemon dies and comes back: neither touches it in
    between. The first request engine A serves afterwards is offloaded in its own
    steps (its stores planned from the first scheduling step on), and engine B loads
    all of it."""
    a, b = engines
    live.kill()
    if not warm:
        drop_region()
    d2 = daemon()
    try:
        time.sleep(1.0)  # the engines idle; nothing of theirs runs meanwhile
        p = prompt()
        a.add(("qo-s", p, 4))
        first = a.schedule()  # the prompt's prefill: its blocks are stored at once
        assert first["stores"] >= 1, "the first request after the outage is not offloaded"
        a.execute()
        finish(a)
        held = stored(d2)
        assert held >= len(p) // 16
        b.sees(held)
        b.add(("qo-l", p, 4))
        assert b.schedule()["load_blocks"] == len(p) // 16
        b.execute()
        assert finish(b)["loads"] >= 1
    finally:
        d2.kill()


def test_sigterm_a_cold_restart_and_new_stores(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    assert live.stop() == 0  # drained and clean; with --keep-region the region stays
    drop_region()  # ... so drop it: the next daemon starts cold
    p = prompt()
    a.add(("tc-1", p, 4))
    finish(a)  # runs without the daemon
    d2 = daemon()
    a.connected()
    b.connected()
    a.add(("tc-2", prompt(), 4))
    finish(a)
    b.add(("tc-3", p, 4))  # stored before the restart: gone, recomputed
    assert b.schedule()["loads"] == 0
    b.execute()
    finish(b)
    d2.kill()


def test_a_daemon_that_never_comes_back_costs_hits_only(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    live.kill()
    drop_region()
    for e, name in ((a, "na"), (b, "nb")):
        e.add(*[(f"{name}{i}", prompt(3), 6) for i in range(6)])
        st = finish(e)
        assert outages(st) == 2  # once per connection, not per request or step


def test_a_socket_that_disappears_changes_nothing_for_connected_engines(
    engines: tuple[EngineProc, EngineProc], live: DaemonProcess
) -> None:
    a, b = engines
    admin = kvoffload.connect(SOCK)
    os.unlink(SOCK)
    p = prompt()
    a.add(("sd-s", p, 4))
    finish(a)
    b.sees(int(admin.stats()["blocks"]["used_blocks"]))
    admin.close()
    b.add(("sd-l", p, 4))
    assert b.schedule()["loads"] == 1  # the old connections still serve
    b.execute()
    finish(b)
    live.kill()
    b.add(("sd-2", prompt(), 4))
    finish(b)  # and once it is gone too, nothing but misses
