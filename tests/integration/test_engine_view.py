"""An engine's view of a namespace (every scheduler answer local) against a live daemon.

Two engines share one namespace; one stores through its leased slots with a streaming
worker, the other sees the blocks through its pushed feed. In steady state no call
makes a blocking round trip; while the daemon is away everything misses at once, and
the view comes back by itself when the daemon does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from engines import FACTOR, filled_caches, keys, layout
from helpers import poll

import kvoffload
from kvoffload.engine.streaming import StreamingWorker
from kvoffload.engine.view import EngineView, KeyState
from kvoffloadbench.launch import DaemonProcess

HIT, MISS, PENDING = KeyState.HIT, KeyState.MISS, KeyState.HIT_PENDING


def step(view: EngineView) -> None:
    """One scheduler step with nothing else to do: the batch goes, pushes come in."""
    view.end_step()
    view.lookup(b"")  # the next step begins: reads what arrived


def settle(view: EngineView, predicate: Callable[[], object], what: str) -> None:
    def again() -> bool:
        step(view)
        return bool(predicate())

    poll(again, what, deadline_s=20)


def finished(w: StreamingWorker, job: int) -> kvoffload.TransferResult:
    out: list[kvoffload.TransferResult] = []

    def got() -> bool:
        out.extend(r for r in w.get_finished() if r.job_id == job)
        return bool(out)

    poll(got, f"job {job}")
    return out[0]


def test_two_engines_share_blocks_with_no_round_trip_per_step(daemon: DaemonProcess) -> None:
    a, b = kvoffload.connect(daemon.socket_path), kvoffload.connect(daemon.socket_path)
    ns_a, ns_b = a.namespace("v", layout()), b.namespace("v", layout())
    va, vb = EngineView(ns_a, lease_blocks=8), EngineView(ns_b, keep_events=True)
    worker_client = kvoffload.connect(daemon.socket_path)
    wns = worker_client.namespace("v", layout(), subscribe=False)
    w = StreamingWorker(wns, filled_caches(3))
    settle(va, lambda: len(va.leases) >= 8, "a's first lease grant")

    ks = keys(b"s", 4)
    assert [va.lookup(k) for k in ks] == [MISS] * 4
    plan = va.prepare_store(ks)
    assert plan is not None and plan[0] == ks
    assert [va.lookup(k) for k in ks] == [PENDING] * 4
    assert w.submit_store(1, np.arange(4 * FACTOR), plan[1], lease=ns_a.lease)
    va.end_step()  # the claims go out; the worker's copy runs meanwhile
    assert finished(w, 1).success
    va.complete_store(ks)
    assert va.lookup(ks[0]) == MISS  # committed here, never a hit before the daemon confirms
    settle(va, lambda: va.lookup(ks[0]) == HIT, "a's own commit in its feed")
    settle(vb, lambda: vb.lookup(ks[3]) == HIT, "b seeing a's blocks")
    assert vb.ready[ks[2]] == va.ready[ks[2]] == plan[1][2]  # the slot came with the event

    # b loads them through its own streaming worker, by key: byte-exact
    lc = kvoffload.connect(daemon.socket_path)
    lw = StreamingWorker(lc.namespace("v", layout(), subscribe=False), filled_caches(99))
    slots = vb.prepare_load(ks)
    assert lw.submit_load(2, slots, np.arange(4 * FACTOR) + 20, keys=ks)
    assert finished(lw, 2).success
    vb.complete_load(ks)
    for src, dst in zip(filled_caches(3), lw.caches):
        assert bool((src[: 4 * FACTOR] == dst[20 : 20 + 4 * FACTOR]).all())

    # evictions reach b's view through the feed as well
    assert a.evict("v", keys=[ks[0]]) == 1
    settle(vb, lambda: vb.lookup(ks[0]) == MISS, "b seeing the eviction")
    assert [(set(x), r) for x, r in vb.events] == [(set(ks), False), ({ks[0]}, True)]
    assert va.blocking_calls_total == vb.blocking_calls_total == 0
    for c in (worker_client, lc, a, b):
        c.close()


def test_an_outage_costs_hits_never_latency_and_the_view_comes_back() -> None:
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    c = kvoffload.connect(d.socket_path, timeout_s=1.0)
    view = EngineView(c.namespace("o", kvoffload.KVLayout([4096])))
    settle(view, lambda: view.leases, "the first lease grant")
    assert view.prepare_store([b"k"]) == ([b"k"], [view.writing[b"k"]])
    d.kill()
    trips, blocking = c.round_trips_total, view.blocking_calls_total
    step(view)  # the step that finds the daemon gone
    assert view.lookup(b"k") == MISS and view.lookup(b"x") == MISS
    assert view.prepare_store([b"y"]) == ([], [])  # nothing to do: vLLM neither waits nor warns
    # nothing waited on the daemon: no request was made, none could time out
    assert (c.round_trips_total, view.blocking_calls_total) == (trips, blocking)
    assert c.outages_total == 1
    d2 = DaemonProcess(  # the same instance: it adopts, then removes, the killed one's region
        "64MiB", "--log-level", "warning", socket_path=d.socket_path, instance=d.instance
    ).start()
    # found by the keeper's retries, capped at RETRY_MAX_S (tests/unit/test_reconnect.py)
    settle(view, lambda: view.connected and view.leases, "the view after the restart")
    assert view.prepare_store([b"y"]) == ([b"y"], [view.writing[b"y"]])
    c.close()
    assert d2.stop() == 0


def test_a_quiet_outage_is_over_before_the_engines_next_step() -> None:
    """The engine does nothing while the daemon dies and comes back. Its client sees
    the hang-up by itself and connects again in the background (the namespace
    reopened, the mirror's snapshot taken, the first lease grant received), so the
    engine's first step afterwards stores without a round trip: a dead connection it
    had not noticed is dropped when the new one is adopted."""
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    c = kvoffload.connect(d.socket_path, timeout_s=1.0)
    view = EngineView(c.namespace("q", kvoffload.KVLayout([4096])))
    settle(view, lambda: view.connected and view.leases, "the first lease grant")
    view.end_step()  # the engine's last step before it idles
    epoch = c.epoch
    d.kill()
    d2 = DaemonProcess(
        "64MiB", "--log-level", "warning", socket_path=d.socket_path, instance=d.instance
    ).start()
    try:
        poll(lambda: c._pending is not None, "the keeper's new connection", deadline_s=5)
        assert c.epoch == epoch and c.outages_total == 1  # noticed, not yet adopted
        calls = c.round_trips_total
        assert view.lookup(b"z") == MISS  # the step's first call adopts it
        plan = view.prepare_store([b"z"])
        assert plan == ([b"z"], [view.writing[b"z"]])  # from the lease that came with it
        assert c.epoch == epoch + 1 and view.lease_fallbacks_total == 0
        assert c.round_trips_total == calls  # no blocking call on the engine's thread
        view.end_step()
    finally:
        c.close()
        assert d2.stop() == 0
