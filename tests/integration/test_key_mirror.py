"""The client-side key mirror (vLLM lookups without a round trip) against a live daemon."""

from __future__ import annotations

import time

import numpy as np
from engines import FACTOR, PAGES, keys, layout, wait_done

import kvoffload
from kvoffload.mirror import KeyMirror, KeyState
from kvoffload.vllm.identity import VllmIdentity
from kvoffloadctl.launch import DaemonProcess


def test_mirror_follows_other_engines_and_its_own_calls(daemon: DaemonProcess) -> None:
    a, b = kvoffload.connect(daemon.socket_path), kvoffload.connect(daemon.socket_path)
    ns_a, ns_b = a.namespace("m", layout()), b.namespace("m", layout())
    mirror = KeyMirror(ns_b, max_age_s=3600.0, keep_events=True)
    w = ns_a.attach_worker([kvoffload.shared_kv_cache(64, p) for p in PAGES])
    early = keys(b"x", 2)
    plan = ns_a.prepare_store(early)
    assert plan is not None
    assert w.submit_store(1, np.arange(2 * FACTOR), plan.slots) and wait_done(w, 1).success
    ns_a.complete_store(early)
    # first use: a snapshot (blocks stored before the mirror existed are hits)
    assert [mirror.lookup(x) for x in early] == [KeyState.HIT, KeyState.HIT]
    assert mirror.snapshots_total == 1
    assert a.evict("m", keys=[early[0]]) == 1
    assert mirror.lookup(early[0]) == KeyState.HIT  # not refreshed yet (max_age_s)
    mirror.refresh()
    assert mirror.lookup(early[0]) == KeyState.MISS and mirror.lookup(early[1]) == KeyState.HIT
    # its own store: pending while in flight, a hit once complete, events reported
    own = keys(b"y", 1)
    plan_b = ns_b.prepare_store(own)
    assert plan_b is not None
    mirror.stores_prepared(plan_b.keys_to_store, plan_b.evicted_keys)
    assert mirror.lookup(own[0]) == KeyState.HIT_PENDING
    ns_b.complete_store(own, success=False)
    mirror.stores_completed(own, False)
    assert mirror.lookup(own[0]) == KeyState.MISS
    mirror.refresh()
    # the first snapshot reported what was already there; then the eviction
    assert [(set(ks), r) for ks, r in mirror.events] == [(set(early), False), ({early[0]}, True)]
    w.close()
    a.close()
    b.close()


def test_mirror_resyncs_after_a_restart_and_degrades_while_down() -> None:
    d = DaemonProcess("64MiB", "--log-level", "warning").start()
    c = kvoffload.connect(d.socket_path, lazy=True, timeout_s=1.0)
    ns = c.namespace("m", kvoffload.KVLayout([4096]))
    mirror = KeyMirror(ns, max_age_s=0.0, retry_s=0.2)
    assert mirror.lookup(b"k") == KeyState.MISS
    assert d.stop() == 0
    assert mirror.lookup(b"k") == KeyState.RETRY  # reconnecting: ask again later
    time.sleep(0.25)
    assert mirror.lookup(b"k") == KeyState.MISS  # the cache is down: plain misses
    d2 = DaemonProcess("64MiB", "--log-level", "warning", socket_path=d.socket_path).start()
    deadline = time.monotonic() + 10
    while mirror.snapshots_total < 2 and time.monotonic() < deadline:
        mirror.lookup(b"k")
        time.sleep(0.05)
    assert mirror.snapshots_total == 2  # a fresh snapshot after reconnecting
    c.close()
    assert d2.stop() == 0


def test_vllm_identity_shares_equal_instances_and_separates_the_rest() -> None:
    def ident(**kw: object) -> VllmIdentity:
        base: dict[str, object] = {
            "model": "m/a",
            "kv_dtype": "bfloat16",
            "worker_kv_bytes_per_block": 65536,
            "world_size": 2,
            "blocks_per_chunk": 4,
            "tokens_per_block": (16,),
            "tokens_per_hash": 16,
        }
        base.update(kw)
        return VllmIdentity(**base)  # type: ignore[arg-type]

    name, lay = ident().namespace()
    assert name.startswith("vllm/m/a/") and lay.tensor_page_bytes == [65536]
    assert (lay.world_size, lay.block_size_factor, lay.model) == (2, 4, "m/a")
    assert ident().namespace() == ident().namespace()
    for change in (
        {"model": "m/b"},
        {"kv_dtype": "fp8"},
        {"world_size": 4},
        {"blocks_per_chunk": 2},
        {"tokens_per_block": (32,)},
        {"cache_salt": "v2"},
        {"kv_cache_layout": "HND"},
    ):
        assert ident(**change).namespace()[0] != name, change
    assert ident().namespace("shared")[0] == "shared"
