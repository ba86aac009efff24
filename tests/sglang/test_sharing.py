"""Two SGLang instances (two processes) on one daemon: what shares with what.

Each instance is SGLang's real controller and host pool in its own process
(``kvoffloadbench.sglang_proc``); pages are compared by digest.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

import kvoffload
from kvoffloadbench import sglang_rig as rig
from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.sglang_proc import InstanceProcess

PAGE = 4
# What these scenarios share is under test, not how fast: a call's deadline (0.4 s by
# default, tests/sglang/test_faults.py holds it) is given room for a loaded CI machine.
DEADLINE_S = 10.0


def spawn(daemon: DaemonProcess, allocator: str = "default", **kw: Any) -> InstanceProcess:
    extra = {"socket_path": daemon.socket_path, "allocator": allocator, "deadline_s": DEADLINE_S}
    extra.update(kw.pop("extra", {}))
    kw.setdefault("layout", "page_first")
    kw.setdefault("page_size", PAGE)
    kw.setdefault("pages", 64)
    return InstanceProcess(extra_config=extra, **kw)


def load_seen(
    inst: InstanceProcess, seed: int, pages: int, page_size: int = PAGE
) -> tuple[int, int, list[str]]:
    """``inst.load`` once its hit query sees every page another instance just backed
    up: hit queries answer from the instance's key mirror, which the daemon's pushes
    bring up to date a moment after the backup returned (later on a loaded machine).
    A query that does not see them all yet is asked again, up to ``DEADLINE_S``."""
    end = time.monotonic() + DEADLINE_S
    while True:
        got = inst.load(seed, pages)
        if got[0] >= pages * page_size or time.monotonic() > end:
            return got
        time.sleep(0.05)


def stored_blocks(daemon: DaemonProcess) -> dict[str, int]:
    with kvoffload.connect(daemon.socket_path) as c:
        return {n: s["stored_blocks"] for n, s in c.stats()["namespaces"].items()}


def test_second_instance_loads_the_first_ones_backups(daemon: DaemonProcess) -> None:
    """Scenario: instance A (shm host pool: daemon copies) backs up a prompt; instance
    B (default allocator: client copies) prefetches it: every page hits and B's host
    pool holds A's bytes."""
    with spawn(daemon, "shm") as a, spawn(daemon, "default") as b:
        assert a.namespaces == b.namespaces
        done, want = a.store(1, 10)
        assert done == 10 * PAGE
        hit, loaded, got = load_seen(b, 1, 10)
        assert (hit, loaded) == (10 * PAGE, 10 * PAGE)
        assert got == want
        # ... and back the other way
        done, want = b.store(2, 5)
        assert done == 5 * PAGE
        assert load_seen(a, 2, 5) == (5 * PAGE, 5 * PAGE, want)


def test_mla_at_two_tp_sizes_stores_one_copy(daemon: DaemonProcess) -> None:
    """Scenario: an MLA model at TP=2: rank 0 writes, rank 1 (not SGLang's storage
    writer) writes nothing; rank 3 of a TP=4 instance reads every page of the one copy."""
    mla = {"mla": True}
    with (
        spawn(daemon, model=mla, tp_rank=0, tp_size=2) as r0,
        spawn(daemon, model=mla, tp_rank=1, tp_size=2) as r1,
        spawn(daemon, model=mla, tp_rank=3, tp_size=4) as other,
    ):
        assert r0.namespaces == r1.namespaces == other.namespaces
        done, want = r0.store(3, 8)
        assert done == 8 * PAGE
        assert r1.store(3, 8)[0] == 0  # SGLang skips the backup of a non-writer
        assert load_seen(other, 3, 8) == (8 * PAGE, 8 * PAGE, want)
        assert load_seen(r1, 3, 8) == (8 * PAGE, 8 * PAGE, want)
        assert stored_blocks(daemon) == {r0.namespaces[0]: 8}


def test_page_head_tp2_shares_heads_with_tp4(daemon: DaemonProcess) -> None:
    """Scenario (SGLang PR #18541): page_head layout with tp_lcm_size 4. A TP=2 rank 0
    holds heads 0-3, stored as virtual shards 0/4 and 1/4; ranks 0 and 1 of a TP=4
    instance (heads 0-1 and 2-3) load exactly those halves."""
    lcm = {"tp_lcm_size": 4}
    with (
        spawn(daemon, layout="page_head", model={"heads": 4}, tp_size=2, extra=lcm) as tp2,
        spawn(
            daemon, layout="page_head", model={"heads": 2}, tp_rank=0, tp_size=4, extra=lcm
        ) as r0,
        spawn(
            daemon, layout="page_head", model={"heads": 2}, tp_rank=1, tp_size=4, extra=lcm
        ) as r1,
    ):
        assert tp2.namespaces == [*r0.namespaces, *r1.namespaces]
        done, shards = tp2.store(4, 6, split=2)
        assert done == 6 * PAGE
        assert load_seen(r0, 4, 6) == (6 * PAGE, 6 * PAGE, shards[0::2])
        assert load_seen(r1, 4, 6) == (6 * PAGE, 6 * PAGE, shards[1::2])


VARIANTS: dict[str, dict[str, Any]] = {
    "model": {"model_name": "another-model"},
    "dtype": {"model": rig.Model(dtype=torch.float16)},
    "layout": {"layout": "page_first_direct"},
    "page_size": {"page_size": 8},
    "heads": {"model": rig.Model(heads=2, head_dim=64)},
    "tp_shard": {"tp_rank": 1, "tp_size": 2},
    "cache_salt": {"extra": {"cache_salt": "v2-weights"}},
}


def test_instances_that_differ_share_nothing(daemon: DaemonProcess) -> None:
    """Scenario: equal page keys, but another model, KV dtype, host layout, page size,
    head geometry (same page bytes), TP shard or cache salt: each misses every page,
    and its own backup lands in a namespace of its own."""
    with spawn(daemon) as base:
        assert base.store(5, 8)[0] == 8 * PAGE
    names = set(stored_blocks(daemon))
    for what, change in VARIANTS.items():
        kw: dict[str, Any] = {"layout": "page_first", "page_size": PAGE, "model": rig.Model()}
        extra = {"socket_path": daemon.socket_path, **change.pop("extra", {})}
        kw.update(change)
        inst = rig.Instance(kw.pop("model"), kw.pop("layout"), kw.pop("page_size"), 64, extra, **kw)
        try:
            tokens = rig.page_tokens(5, 8, inst.page_size)
            assert inst.prefetch(tokens).hit_tokens == 0, what
            host = inst.alloc(2)
            inst.fill(host, 9)
            assert inst.backup(host, tokens[: 2 * inst.page_size]) == 2 * inst.page_size
            assert not set(inst.backend.namespaces) & names, what
            names |= set(inst.backend.namespaces)
        finally:
            inst.close()


def test_backups_succeed_in_a_full_region_while_other_instances_mirror_it() -> None:
    """Scenario: the region is full and every backup must evict; evicted blocks are
    held for the other instance's key mirror until it acknowledges the evictions
    (daemon: NO_SPACE until then). Backups wait for that within their deadline:
    every one succeeds, and the newest prompts load byte-exact in the other instance."""
    with DaemonProcess(
        "32MiB", "--log-level", "warning", "--extent-size", "2MiB",
        settings={"max_writing_fraction": 1.0},
    ) as d:  # fmt: skip
        extra = {"socket_path": d.socket_path, "deadline_s": DEADLINE_S}
        with spawn(d, page_size=16, pages=256) as other:
            inst = rig.Instance(rig.Model(), "page_first", 16, 256, extra)
            try:
                host = inst.alloc(128)
                for seed in range(12):  # 12 x 4 MiB into a 32 MiB region
                    inst.fill(host, seed)
                    tokens = rig.page_tokens(seed, 128, 16)
                    assert inst.backup(host, tokens) == 128 * 16, seed
                want = inst.page_bytes(host)
            finally:
                inst.close()
            hit, loaded, got = load_seen(other, 11, 128, page_size=16)
            assert (hit, loaded) == (128 * 16, 128 * 16)
            assert got == [hashlib.sha256(p).hexdigest() for p in want]
