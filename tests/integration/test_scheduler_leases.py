"""An engine's scheduler and its workers on connections of their own (vLLM's processes):
a worker stores into the slots the scheduler prepared by naming the plan's lease token;
without it the store is refused (invariant 9)."""

from __future__ import annotations

import numpy as np
import torch

import kvoffload
from kvoffloadbench.launch import DaemonProcess

PAGE = 4096
LAYOUT = kvoffload.KVLayout(tensor_page_bytes=[PAGE])


def test_workers_store_into_their_schedulers_slots_with_its_lease() -> None:
    with DaemonProcess("32MiB", "--log-level", "warning") as d:
        scheduler = kvoffload.connect(d.socket_path)
        worker_side = kvoffload.connect(d.socket_path)
        ns = scheduler.namespace("engine", LAYOUT)
        wns = worker_side.namespace("engine", LAYOUT)
        src = kvoffload.shared_kv_cache(8, PAGE)
        src.copy_(torch.randint(-128, 128, (8, PAGE), dtype=torch.int8))
        w = wns.attach_worker([src])
        keys = [b"k%03d" % i for i in range(4)]
        plan = ns.prepare_store(keys)
        assert plan is not None and plan.lease
        assert not w.submit_store(1, np.arange(4), plan.slots)  # not this connection's
        assert isinstance(w.last_error, kvoffload.NotLeasedError)
        assert w.submit_store(2, np.arange(4), plan.slots, lease=plan.lease), w.last_error
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True]
        ns.complete_store(keys)
        dst = kvoffload.shared_kv_cache(8, PAGE)
        w2 = wns.attach_worker([dst])
        lp = ns.prepare_load(keys)
        assert w2.submit_load(3, lp.slots, np.arange(4) + 4)
        w2.wait([3])
        assert all(r.success for r in w2.get_finished())
        ns.complete_load(keys)
        assert torch.equal(dst[4:], src[:4])
        w.close()
        w2.close()
        worker_side.close()
        scheduler.close()
        assert d.stop() == 0
