"""Several engine processes against one real daemon: sharing, isolation, crashes."""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

import engines
import numpy as np
import pytest
from helpers import poll

import kvoffload
from kvoffload.link.transport import MAX_UNANSWERED
from kvoffloadbench.launch import DaemonProcess

CTX = mp.get_context("spawn")
DEADLINE_S = 20.0


def test_three_engines_share_one_namespace(daemon: DaemonProcess) -> None:
    """Scenario: A stores random bytes; B and C, other processes, load them byte-identical."""
    with ProcessPoolExecutor(3, mp_context=CTX) as pool:
        pool.submit(engines.store, daemon.socket_path, "llama", b"A", 12, 1234).result(60)
        b = pool.submit(engines.load_and_compare, daemon.socket_path, "llama", b"A", 12, 1234)
        c = pool.submit(engines.load_and_compare, daemon.socket_path, "llama", b"A", 12, 1234)
        assert b.result(60) == 0
        assert c.result(60) == 0


def test_other_layout_cannot_see_blocks(daemon: DaemonProcess) -> None:
    with ProcessPoolExecutor(1, mp_context=CTX) as pool:
        pool.submit(engines.store, daemon.socket_path, "llama", b"A", 4, 1).result(60)
    client = kvoffload.connect(daemon.socket_path)
    other = kvoffload.KVLayout(tensor_page_bytes=[4096, 4096], block_size_factor=2, model="test")
    with pytest.raises(kvoffload.LayoutMismatchError):
        client.namespace("llama", other)
    ns = client.namespace("llama-fp8", other)
    assert ns.lookup(engines.keys(b"A", 4)) == 0
    assert client.namespace("llama", engines.layout()).lookup(engines.keys(b"A", 4)) == 4
    client.close()


def _ns_stats(client: kvoffload.Client, name: str) -> dict[str, int]:
    stats: dict[str, int] = client.stats()["namespaces"][name]
    return stats


@pytest.mark.parametrize("victim", ["store", "load"])
def test_killed_client_leaves_nothing_pinned_or_half_visible(
    daemon: DaemonProcess, victim: str
) -> None:
    """Invariant 5: kill -9 mid-transfer drops the client's pins and in-flight stores."""
    client = kvoffload.connect(daemon.socket_path)
    ns = client.namespace("llama", engines.layout())
    if victim == "load":
        with ProcessPoolExecutor(1, mp_context=CTX) as pool:
            pool.submit(engines.store, daemon.socket_path, "llama", b"L", 8, 5).result(60)
    ready = CTX.Event()
    target = engines.store_then_die if victim == "store" else engines.load_then_die
    proc = CTX.Process(target=target, args=(daemon.socket_path, "llama", b"L", 8, ready))
    proc.start()
    assert ready.wait(DEADLINE_S)
    proc.join(DEADLINE_S)
    assert proc.exitcode == -9
    poll(lambda: not client.clients() or len(client.clients()) == 1, "the dead client to go")
    poll(lambda: _ns_stats(client, "llama")["writing_blocks"] == 0, "writes to fail")
    st = _ns_stats(client, "llama")
    assert st["pinned_blocks"] == 0
    ks = engines.keys(b"L", 8)
    if victim == "store":
        assert ns.lookup(ks) == 0  # never half-visible
        assert st["store_failures_total"] == 8
        plan = ns.prepare_store(ks)  # the keys can be stored again
        assert plan is not None and plan.keys_to_store == ks
        ns.complete_store(ks, success=False)
    else:
        assert ns.lookup(ks) == 8
        assert client.evict("llama") == 8  # unpinned again, so evictable
    assert daemon.alive()
    client.close()


def test_sigterm_drains_and_exits_cleanly() -> None:
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    client = kvoffload.connect(d.socket_path)
    ns = client.namespace("x", kvoffload.KVLayout(tensor_page_bytes=[1 << 20]))
    caches = [kvoffload.shared_kv_cache(32, 1 << 20)]
    w = ns.attach_worker(caches)
    plan = ns.prepare_store([bytes([i]) * 8 for i in range(32)])
    assert plan is not None
    assert w.submit_store(1, np.arange(32), plan.slots)
    assert d.stop() == 0
    assert not os.path.exists(f"/dev/shm{d.region_name}")
    # The copy drained before exit, but its result died with the daemon: reported failed.
    assert w.get_finished() == [kvoffload.TransferResult(1, False, 0, 0.0)]
    client.close()


def test_daemon_down_means_misses_then_reconnect() -> None:
    """Invariant 7: no crash, no hang while the daemon is gone; reconnect when it is back."""
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    layout = kvoffload.KVLayout(tensor_page_bytes=[4096])
    client = kvoffload.connect(d.socket_path, timeout_s=2.0)
    ns = client.namespace("m", layout)
    w = ns.attach_worker([kvoffload.shared_kv_cache(8, 4096)])
    key = [b"k" * 8]
    plan = ns.prepare_store(key)
    assert plan is not None
    assert d.stop() == 0

    trips = client.round_trips_total
    assert ns.lookup(key) == 0
    assert ns.prepare_store(key) is None
    assert w.submit_store(9, [0], plan.slots) is False
    assert isinstance(w.last_error, kvoffload.DaemonUnavailableError)
    ns.complete_store(key)
    ns.touch(key)
    assert ns.take_events() == []
    with pytest.raises(kvoffload.DaemonUnavailableError):
        ns.prepare_load(key)
    # No hang: at most the first call went out (and found the socket closed); every
    # other failed at once, without a request that could wait for an answer.
    assert client.round_trips_total - trips <= 1

    d2 = DaemonProcess(
        "64MiB", "--log-level", "warning", instance=d.instance, socket_path=d.socket_path
    ).start()
    try:

        def reconnected() -> bool:
            return ns.prepare_store(key) is not None

        poll(reconnected, "the client to reconnect")
        assert client.epoch == 2
        plan = ns.prepare_store(key)  # already leased on the new daemon: empty plan
        assert plan is not None and plan.keys_to_store == []
    finally:
        client.close()
        assert d2.stop() == 0


def test_fire_and_forget_requests_wait_for_their_replies_in_bounded_batches(
    daemon: DaemonProcess,
) -> None:
    """A client that floods one-way requests (``touch``) never has more than
    ``MAX_UNANSWERED`` of them unanswered: its next blocking call waits behind at most
    that much of its own queued work, not behind a backlog of the daemon's whole
    per-connection allowance."""
    client = kvoffload.connect(daemon.socket_path)
    ns = client.namespace("touchy", engines.layout())
    keys = engines.keys(b"T", 16)
    most = 0
    for _ in range(20 * MAX_UNANSWERED):
        ns.touch(keys)
        t = client._transport
        assert t is not None
        most = max(most, t.unanswered)
    assert most == MAX_UNANSWERED
    assert ns.lookup(keys) == 0  # the connection is still in step: replies matched
    assert client.outages_total == 0
    client.close()
