"""Calls larger than one request may be: the daemon answers at most MAX_STATE_KEYS keys
per state-changing request (so no request holds its loop long), and the client library
splits larger calls, all or nothing."""

from __future__ import annotations

import numpy as np
import pytest

import kvoffload
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.messages import MAX_STATE_KEYS
from kvoffload.protocol.packing import pack_keys
from kvoffloadbench.launch import DaemonProcess

PAGE = 4096


def keys(tag: bytes, n: int) -> list[bytes]:
    return [tag + b"%07d" % i for i in range(n)]


def test_a_call_of_more_keys_than_a_request_holds_goes_in_parts() -> None:
    n = 2 * MAX_STATE_KEYS + 100
    with DaemonProcess("256MiB", "--log-level", "warning", settings={"min_slot_size": "4KiB"}) as d:
        with kvoffload.connect(d.socket_path) as c:
            ns = c.namespace("big", kvoffload.KVLayout(tensor_page_bytes=[PAGE]))
            w = ns.attach_worker([kvoffload.shared_kv_cache(n, PAGE)])
            ks = keys(b"k", n)
            plan = ns.prepare_store(ks)
            assert plan is not None and len(plan.slots) == n == len(set(plan.slots))
            assert w.submit_store(1, np.arange(n), plan.slots)
            w.wait([1])
            assert all(r.success for r in w.get_finished())
            ns.complete_store(ks)
            assert ns.lookup(ks) == n
            load = ns.prepare_load(ks)
            assert load.slots == plan.slots
            ns.complete_load(ks)
            assert c.stats()["namespaces"]["big"]["pinned_blocks"] == 0
            # the daemon itself refuses a request past the bound, naming it
            kp, kb = pack_keys(keys(b"x", MAX_STATE_KEYS + 1))
            with pytest.raises(InvalidArgumentError, match=f"at most {MAX_STATE_KEYS}"):
                c.call(lambda rid: m.PrepareStore(rid, ns.ns_id, kp, kb), m.StorePlanReply)
        assert d.stop() == 0


def test_a_split_store_that_finds_no_space_plans_nothing() -> None:
    """The region holds fewer blocks than the call asks for: no part stays planned."""
    with DaemonProcess("64MiB", "--log-level", "warning", settings={"min_slot_size": "4KiB"}) as d:
        with kvoffload.connect(d.socket_path) as c:
            ns = c.namespace("small", kvoffload.KVLayout(tensor_page_bytes=[PAGE]))
            capacity = c.stats()["region"]["data_bytes"] // PAGE
            assert capacity < 2 * MAX_STATE_KEYS + MAX_STATE_KEYS
            assert ns.prepare_store(keys(b"s", capacity + MAX_STATE_KEYS)) is None
            stats = c.stats()["namespaces"]["small"]
            assert stats["writing_blocks"] == 0 and stats["stored_blocks"] == 0
        assert d.stop() == 0
