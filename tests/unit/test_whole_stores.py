"""A block is visible only over bytes its writers wrote in that store (invariant 12).

The service runs in-process with a real region and copier. A store must write each of
its slots whole: every registered cache, every engine block of every slot; canonical
parts must together cover every canonical page; and a slot with a store copy still
running does not become visible. Anything less fails the store (its slot is freed),
so a slot that held another block before never shows that block's bytes.
"""

from __future__ import annotations

import os
import select
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from test_canonical_parts import CANON, HALF, LOCAL, attach, frags, open_ns, settle

from kvoffload import shared_kv_cache
from kvoffload.cache import describe_cache
from kvoffload.datapath.canonical import CanonicalPart, covers_pages
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
PAGE = 4096


@pytest.fixture
def svc() -> Iterator[Service]:
    cfg = DaemonConfig(instance=f"w{uuid.uuid4().hex[:8]}", region_size="8MiB")
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, MIB, PAGE))
    copier = CpuCopier(2)
    yield Service(cfg, region, copier)
    copier.close()
    region.close()


def finish(svc: Service, worker: int) -> m.JobResult:
    """Drive completions until the worker has one result (a deadline on the poll)."""
    for _ in range(50):
        if svc.workers[worker].finished:
            break
        select.select([svc.copier.wake_fd], [], [], 0.2)
        svc.on_completions(svc.copier.drain())
    (result,) = svc.workers[worker].finished
    svc.workers[worker].finished = []
    return result


def plain_worker(svc: Service, s: Session, ns: int, caches: list[torch.Tensor]) -> int:
    descs, fds = [], []
    for i, c in enumerate(caches):
        desc, fd = describe_cache(c)
        descs.append(m.CacheDesc(desc.kind, desc.num_blocks, desc.page_bytes, i))
        fds.append(os.dup(fd))
    s.fds = fds
    r = handle_now(svc, s, m.AttachWorker(2, ns, 0, descs))
    assert isinstance(r, m.WorkerAttached)
    return r.worker


def prepare(svc: Service, s: Session, ns: int, keys: list[bytes]) -> bytes:
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    return plan.slots


@pytest.mark.parametrize(
    ("f", "caches", "ids", "needle"),
    [
        (1, [0], 2, "names 1 caches"),  # one tensor of two
        (2, [], 3, "3 block ids"),  # half of the second slot
        (2, [1, 0], 2, "2 block ids"),  # one engine block of each
    ],
)
def test_a_store_that_writes_part_of_a_slot_is_refused(
    svc: Service, f: int, caches: list[int], ids: int, needle: str
) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "two", m.KVLayout([PAGE, PAGE], block_size_factor=f)))
    assert isinstance(r, m.NamespaceOpened)
    w = plain_worker(svc, s, r.ns, [shared_kv_cache(8, PAGE), shared_kv_cache(8, PAGE)])
    slots = prepare(svc, s, r.ns, [b"a", b"b"])
    with pytest.raises(InvalidArgumentError, match=f"writes each of its slots whole.*{needle}"):
        svc.handle(s, m.SubmitStore(4, w, 1, pack_ids(range(ids)), slots, caches))
    assert not svc.namespaces[r.ns].slots.is_busy(0)  # nothing started
    whole = svc.handle(s, m.SubmitStore(5, w, 2, pack_ids(range(2 * f)), slots))
    assert isinstance(whole, m.OkReply) and finish(svc, w).success


@pytest.mark.parametrize(
    ("name", "canon"),
    [
        ("one byte of a page", [[HALF(CANON, frags((0, 0, 1)))]]),
        # two parts that both write the first half: the second half is a hole
        ("an overlap and a hole", [[HALF(CANON, frags((0, 0, LOCAL)))]] * 2),
        # MLA-like turns where the writer of odd blocks writes one byte only
        (
            "a lazy writer",
            [[HALF(CANON, frags((0, 0, CANON)), 2, 0)], [HALF(CANON, frags((0, 0, 1)), 2, 1)]],
        ),
    ],
)
def test_canonical_parts_that_leave_a_hole_fail_the_store(
    svc: Service, name: str, canon: list[list[m.CanonicalDesc]]
) -> None:
    """Every part reports its blocks, but what they copied does not cover the page."""
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s)
    parts = len(canon)
    local = CANON if name == "a lazy writer" else LOCAL
    ws = [attach(svc, s, ns, shared_kv_cache(8, local), r, parts, *canon[r]) for r in range(parts)]
    keys = [b"x-%d" % i for i in range(4)]
    slots = prepare(svc, s, ns, keys)
    for job, w in enumerate(ws):
        assert isinstance(
            svc.handle(s, m.SubmitStore(4, w, job, pack_ids(range(4)), slots)), m.OkReply
        )
        assert finish(svc, w).success  # the copies themselves went fine
    kp, kb = pack_keys(keys)
    with pytest.raises(InvalidArgumentError, match="not been copied whole"):
        svc.handle(s, m.CompleteStore(5, ns, kp, kb, True))
    index = svc.namespaces[ns]
    failed = 4 if name != "a lazy writer" else 2  # even blocks were written whole
    assert svc.transfers.sealer.stores_not_covered == failed
    svc.handle(s, m.CompleteStore(6, ns, kp, kb, False))
    assert index.lookup(keys) == 0 and index.statistics().writing_blocks == 0
    settle(svc)


def test_parts_that_cover_the_page_together_make_it_visible_at_once(svc: Service) -> None:
    """The check runs once per set of workers; the job that completes a slot reports
    only after it, so a blocking client's complete_store right after wait succeeds."""
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s)
    halves = [frags((0, 0, 1024), (1024, 2048, 1024)), frags((0, 1024, 1024), (1024, 3072, 1024))]
    ws = [
        attach(svc, s, ns, shared_kv_cache(8, LOCAL), r, 2, HALF(CANON, halves[r])) for r in (0, 1)
    ]
    for round_ in range(2):
        keys = [b"r%d-%d" % (round_, i) for i in range(3)]
        slots = prepare(svc, s, ns, keys)
        for w in ws:
            svc.handle(s, m.SubmitStore(4, w, round_, pack_ids(range(3)), slots))
            assert finish(svc, w).success
        kp, kb = pack_keys(keys)
        assert isinstance(svc.handle(s, m.CompleteStore(5, ns, kp, kb, True)), m.OkReply)
        assert svc.namespaces[ns].lookup(keys) == 3
    assert svc.transfers.sealer.memo_size == 1  # one check for both rounds
    settle(svc)


def test_a_slot_with_a_store_copy_still_running_is_not_visible(svc: Service) -> None:
    """A second copy into a slot that is already written (a client that submits the
    same store twice) keeps the block hidden until it has landed too."""
    s = svc.open_session(1, os.getpid(), 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "one", m.KVLayout([PAGE])))
    assert isinstance(r, m.NamespaceOpened)
    index = svc.namespaces[r.ns]
    w = plain_worker(svc, s, r.ns, [shared_kv_cache(8, PAGE)])
    slots = prepare(svc, s, r.ns, [b"k"])
    svc.handle(s, m.SubmitStore(4, w, 1, pack_ids([0]), slots))
    assert finish(svc, w).success
    arr = np.frombuffer(slots, dtype=np.int64)
    index.slots.mark_busy(arr, store=True)  # as if a second copy were running
    index.commit(0, s.session_id, [b"k"], True)
    assert index.lookup([b"k"]) == 0
    index.slots.unmark_busy(arr, store=True)
    index.mark_written(arr.tolist(), 0)  # that copy landed
    assert index.lookup([b"k"]) == 1


def test_coverage_counts_only_the_parts_whose_turn_it_is() -> None:
    whole = CanonicalPart(64, np.array([[0, 0, 64]], dtype=np.int64))
    half = CanonicalPart(64, np.array([[0, 0, 32]], dtype=np.int64))
    turns = [CanonicalPart(64, whole.frags, 2, w) for w in (0, 1)]
    assert covers_pages([[whole]], 0, 4)
    assert not covers_pages([[half]], 0, 1)
    assert covers_pages([[half], [CanonicalPart(64, np.array([[0, 32, 32]]))]], 0, 1)
    assert covers_pages([[turns[0]], [turns[1]]], 0, 4)  # each page by its writer
    lazy = CanonicalPart(64, half.frags, 2, 1)
    assert covers_pages([[turns[0]], [lazy]], 0, 1)  # page 0 is writer 0's
    assert not covers_pages([[turns[0]], [lazy]], 0, 2)  # page 1 is the lazy one's
    assert not covers_pages([[whole], [whole, whole]], 0, 1)  # parts disagree on caches
