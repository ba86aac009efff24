"""verify_checksums: a stored block whose region bytes change fails its load and goes."""

from __future__ import annotations

import os
import select
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvoffload import shared_kv_cache
from kvoffload.cache import describe_cache
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError, NotFoundError
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
PAGE = 16384


@pytest.fixture
def svc() -> Iterator[Service]:
    cfg = DaemonConfig(
        instance=f"c{uuid.uuid4().hex[:8]}",
        region_size="8MiB",
        extent_size="1MiB",
        verify_checksums=True,
    )
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, MIB, PAGE))
    copier = CpuCopier(2)
    yield Service(cfg, region, copier)
    copier.close()
    region.close()


def attach(svc: Service, s: Session, ns: int, cache: torch.Tensor) -> int:
    desc, fd = describe_cache(cache)
    s.fds = [os.dup(fd)]
    desc = m.CacheDesc(desc.kind, desc.num_blocks, desc.page_bytes, 0)
    r = handle_now(svc, s, m.AttachWorker(2, ns, 0, [desc]))
    assert isinstance(r, m.WorkerAttached)
    return r.worker


def run(svc: Service, req: m.SubmitStore | m.SubmitLoad, s: Session) -> m.JobResult:
    assert isinstance(svc.handle(s, req), m.OkReply)
    r, _, _ = select.select([svc.copier.wake_fd], [], [], 10)
    assert r, "copy did not finish"
    svc.on_completions(svc.copier.drain())
    w = svc.workers[req.worker]
    (result,) = w.finished
    w.finished = []
    return result


def test_corrupted_block_fails_its_load_and_is_evicted(svc: Service) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "c", m.KVLayout([PAGE])))
    assert isinstance(r, m.NamespaceOpened)
    ns = r.ns
    src = shared_kv_cache(8, PAGE)
    src.copy_(torch.randint(-128, 128, (8, PAGE), dtype=torch.int8))
    w = attach(svc, s, ns, src)
    keys = [b"blk-%d" % i for i in range(4)]
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    slots = np.frombuffer(plan.slots, dtype=np.int64)
    assert run(svc, m.SubmitStore(4, w, 1, pack_ids(range(4)), plan.slots), s).success
    svc.handle(s, m.CompleteStore(5, ns, kp, kb, True))

    index = svc.namespaces[ns]
    off = int(index.slots.region_offsets(slots[2:3])[0])
    svc.region.buffer[off + 100] ^= 0xFF  # one flipped byte in block 2, behind our back

    dst = shared_kv_cache(8, PAGE)
    w2 = attach(svc, s, ns, dst)
    lplan = svc.handle(s, m.PrepareLoad(6, ns, kp, kb))
    assert isinstance(lplan, m.LoadPlanReply)
    res = run(svc, m.SubmitLoad(7, w2, 1, lplan.slots, pack_ids(range(4))), s)
    assert not res.success
    assert not dst.any(), "a load that failed verification copied bytes"
    k2, b2 = pack_keys([keys[2]])
    with pytest.raises(NotFoundError, match="corrupt"):
        svc.handle(s, m.PrepareLoad(8, ns, k2, b2))
    svc.handle(s, m.CompleteLoad(9, ns, kp, kb))
    assert index.lookup(keys) == 2 and index.lookup(keys[3:]) == 1  # block 2 is gone
    assert any(e.removed and keys[2] in e.keys for e in index.take_events(s.session_id))
    assert svc.errors_by_code["CHECKSUM_MISMATCH"] == 1

    good = [keys[0], keys[1], keys[3]]
    kp, kb = pack_keys(good)
    lplan = svc.handle(s, m.PrepareLoad(10, ns, kp, kb))
    assert isinstance(lplan, m.LoadPlanReply)
    assert run(svc, m.SubmitLoad(11, w2, 2, lplan.slots, pack_ids([0, 1, 3])), s).success
    assert torch.equal(dst[[0, 1, 3]], src[[0, 1, 3]])


def test_a_cache_count_that_does_not_fit_the_layout_is_refused_and_fds_closed(
    svc: Service,
) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "two", m.KVLayout([PAGE, PAGE])))
    assert isinstance(r, m.NamespaceOpened)
    cache = shared_kv_cache(8, PAGE)
    desc, fd = describe_cache(cache)
    s.fds = [os.dup(fd)]
    sent = s.fds[0]
    one = m.CacheDesc(desc.kind, desc.num_blocks, desc.page_bytes, 0)
    with pytest.raises(InvalidArgumentError, match="do not tile"):
        handle_now(svc, s, m.AttachWorker(2, r.ns, 0, [one]))
    deadline = time.monotonic() + 10  # the daemon's closer thread closes it
    while os.path.exists(f"/proc/self/fd/{sent}"):
        assert time.monotonic() < deadline, "the descriptor it was given stayed open"
        time.sleep(0.01)
