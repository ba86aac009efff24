"""Canonical pages in the daemon: parts of an engine's ranks make one block.

The service runs in-process with a real region and copier; each "rank" is a worker
with its own memfd cache and its own fragments. A canonical namespace has world size
1: a block is visible only once every part has landed, ranks holding the same bytes
take turns by block, the checksum is taken of the whole page, and mappings that
reach outside a page are refused.
"""

from __future__ import annotations

import itertools
import os
import select
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import shared_kv_cache
from kvoffload.cache import describe_cache
from kvoffload.datapath.canonical import CanonicalPart, expand
from kvoffload.datapath.copyplan import place_caches
from kvoffload.protocol import messages as m
from kvoffload.protocol.errors import InvalidArgumentError
from kvoffload.protocol.packing import pack_ids, pack_keys
from kvoffloadbench.inproc import handle_now
from kvoffloadd.config import DaemonConfig
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.copies.seals import Sealer
from kvoffloadd.region.region import Geometry, SharedOffloadRegion
from kvoffloadd.service.service import Service
from kvoffloadd.service.session import Session

MIB = 1 << 20
LOCAL = 2048  # one rank's page (half the heads)
CANON = 4096  # the canonical page: both halves
HALF = m.CanonicalDesc  # shorthand below


def frags(*rows: tuple[int, int, int]) -> bytes:
    return np.asarray(rows, dtype="<i8").tobytes()


@pytest.fixture
def svc() -> Iterator[Service]:
    cfg = DaemonConfig(
        instance=f"p{uuid.uuid4().hex[:8]}", region_size="8MiB", verify_checksums=True
    )
    region = SharedOffloadRegion(cfg.region_name, Geometry.plan(cfg.region_bytes, MIB, CANON))
    copier = CpuCopier(2)
    yield Service(cfg, region, copier)
    copier.close()
    region.close()


def open_ns(svc: Service, s: Session, f: int = 1) -> int:
    r = svc.handle(s, m.OpenNamespace(1, f"canon{f}", m.KVLayout([CANON], block_size_factor=f)))
    assert isinstance(r, m.NamespaceOpened)
    return r.ns


def attach(
    svc: Service, s: Session, ns: int, cache: torch.Tensor, rank: int, parts: int, *canon: HALF
) -> int:
    desc, fd = describe_cache(cache)
    s.fds = [os.dup(fd)]
    d = m.CacheDesc(desc.kind, desc.num_blocks, desc.page_bytes, 0)
    r = handle_now(svc, s, m.AttachWorker(2, ns, rank, [d], parts=parts, canonical=list(canon)))
    assert isinstance(r, m.WorkerAttached)
    return r.worker


def run(svc: Service, req: m.SubmitStore | m.SubmitLoad, s: Session) -> m.JobResult:
    assert isinstance(svc.handle(s, req), m.OkReply)
    deadline = 50
    while deadline and not svc.workers[req.worker].finished:
        select.select([svc.copier.wake_fd], [], [], 0.2)
        svc.on_completions(svc.copier.drain())
        deadline -= 1
    (result,) = svc.workers[req.worker].finished
    svc.workers[req.worker].finished = []
    return result


def settle(svc: Service) -> None:
    """Run the copier's pending checksum jobs to their completion."""
    while svc.inflight_jobs:
        select.select([svc.copier.wake_fd], [], [], 0.2)
        svc.on_completions(svc.copier.drain())


def test_a_block_is_visible_only_once_every_part_has_landed(svc: Service) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s)
    caches = [shared_kv_cache(8, LOCAL) for _ in range(2)]
    for i, c in enumerate(caches):
        c.copy_(torch.full((8, LOCAL), 10 * i + 1, dtype=torch.int8))
    # rank 0 holds the first half of every canonical page, rank 1 the second (strided)
    w0 = attach(svc, s, ns, caches[0], 0, 2, HALF(CANON, frags((0, 0, 1024), (1024, 2048, 1024))))
    w1 = attach(
        svc, s, ns, caches[1], 1, 2, HALF(CANON, frags((0, 1024, 1024), (1024, 3072, 1024)))
    )
    keys = [b"blk-%d" % i for i in range(3)]
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    assert run(svc, m.SubmitStore(4, w0, 1, pack_ids(range(3)), plan.slots), s).success
    with pytest.raises(InvalidArgumentError, match="not been copied whole by all"):
        svc.handle(s, m.CompleteStore(5, ns, kp, kb, True))  # rank 1's part is missing
    index = svc.namespaces[ns]
    assert index.lookup(keys) == 0
    assert run(svc, m.SubmitStore(6, w1, 1, pack_ids(range(3)), plan.slots), s).success
    svc.handle(s, m.CompleteStore(7, ns, kp, kb, True))
    assert index.lookup(keys) == 3
    settle(svc)

    # a one-part reader (TP 1) of the whole canonical page
    whole = shared_kv_cache(8, CANON)
    reader = attach(svc, s, ns, whole, 0, 1, HALF(CANON, frags((0, 0, CANON))))
    lplan = svc.handle(s, m.PrepareLoad(8, ns, kp, kb))
    assert isinstance(lplan, m.LoadPlanReply)
    assert run(svc, m.SubmitLoad(9, reader, 1, lplan.slots, pack_ids(range(3))), s).success
    quarters = whole[:3].view(3, 4, 1024)
    assert (quarters[:, 0::2] == 1).all() and (quarters[:, 1::2] == 11).all()

    # the checksum was taken of the whole page: a flipped byte fails the next load
    slots = np.frombuffer(lplan.slots, dtype=np.int64)
    off = int(index.slots.region_offsets(slots[1:2])[0])
    svc.region.buffer[off + 3000] ^= 0xFF
    svc.handle(s, m.CompleteLoad(10, ns, kp, kb))
    lplan = svc.handle(s, m.PrepareLoad(11, ns, kp, kb))
    assert isinstance(lplan, m.LoadPlanReply)
    assert not run(svc, m.SubmitLoad(12, reader, 2, lplan.slots, pack_ids(range(3))), s).success
    assert svc.errors_by_code["CHECKSUM_MISMATCH"] == 1


@pytest.mark.parametrize("f", [1, 2])  # engine blocks per offloaded block
def test_ranks_holding_the_same_bytes_take_turns(svc: Service, f: int) -> None:
    """MLA: every rank holds the whole latent; each engine block is written by one
    of them (with f = 2, the two halves of one slot by different ranks)."""
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s, f)
    caches = [shared_kv_cache(16, CANON) for _ in range(2)]
    data = torch.randint(-128, 128, (16, CANON), dtype=torch.int8)
    for c in caches:
        c.copy_(data)
    ws = [
        attach(svc, s, ns, caches[r], r, 2, HALF(CANON, frags((0, 0, CANON)), 2, r))
        for r in range(2)
    ]
    keys = [b"lat-%d" % i for i in range(6)]
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    blocks = pack_ids(range(6 * f))
    moved = [run(svc, m.SubmitStore(4, w, 1, blocks, plan.slots), s) for w in ws]
    assert all(r.success for r in moved)
    assert sum(r.nbytes for r in moved) == 6 * f * CANON  # one copy of each block in all
    assert {r.nbytes for r in moved} == {3 * f * CANON}  # in turns: half each
    svc.handle(s, m.CompleteStore(5, ns, kp, kb, True))
    out = shared_kv_cache(16, CANON)
    reader = attach(svc, s, ns, out, 0, 1, HALF(CANON, frags((0, 0, CANON))))
    lplan = svc.handle(s, m.PrepareLoad(6, ns, kp, kb))
    assert isinstance(lplan, m.LoadPlanReply)
    assert run(svc, m.SubmitLoad(7, reader, 1, lplan.slots, blocks), s).success
    assert torch.equal(out[: 6 * f], data[: 6 * f])


@pytest.mark.parametrize(
    ("rank", "parts", "canon", "needle"),
    [
        (0, 2, [HALF(CANON, frags((0, 0, LOCAL + 1)))], "outside"),  # past the local page
        (0, 2, [HALF(CANON, frags((0, CANON - 10, 20)))], "outside"),  # past the canonical
        (0, 2, [HALF(CANON, frags((0, 0, 0)))], "outside"),  # an empty fragment
        (0, 2, [HALF(CANON, frags((-8, 0, 8)))], "outside"),
        (0, 2, [HALF(CANON, b"12345")], "triples"),
        (0, 2, [HALF(CANON, frags((0, 0, 8)), 3, 0)], "writer"),  # 3 writers of 2 parts
        (0, 2, [HALF(CANON, frags((0, 0, 8)), 2, 2)], "writer"),
        (2, 2, [HALF(CANON, frags((0, 0, 8)))], "rank 2 of 2"),
        (0, 99, [HALF(CANON, frags((0, 0, 8)))], "parts"),
        (0, 2, [], "0 canonical mappings for 1"),
        (0, 2, [HALF(CANON // 2, frags((0, 0, 8)))], "do not tile"),  # pages must fill the slot
    ],
)
def test_bad_mappings_are_refused_naming_why(
    svc: Service, rank: int, parts: int, canon: list[m.CanonicalDesc], needle: str
) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s)
    with pytest.raises(InvalidArgumentError, match=needle):
        attach(svc, s, ns, shared_kv_cache(4, LOCAL), rank, parts, *canon)
    assert svc.handle(s, m.Ping(9)) is not None  # the daemon goes on


def test_a_transfer_that_would_expand_past_the_copy_limit_is_refused(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks times fragments is what the loop builds arrays for: a worker cannot
    make one submit allocate without bound."""
    import kvoffload.datapath.canonical as canonical

    monkeypatch.setattr(canonical, "MAX_JOB_COPIES", 64)
    s = svc.open_session(1, os.getpid(), 0, 0)
    ns = open_ns(svc, s)
    many = frags(*((i * 64, i * 64, 64) for i in range(32)))  # 32 fragments per block
    w = attach(svc, s, ns, shared_kv_cache(8, LOCAL), 0, 1, HALF(CANON, many))
    keys = [b"big-%d" % i for i in range(3)]
    kp, kb = pack_keys(keys)
    plan = svc.handle(s, m.PrepareStore(3, ns, kp, kb))
    assert isinstance(plan, m.StorePlanReply)
    with pytest.raises(InvalidArgumentError, match="more than the 64 copies"):
        svc.handle(s, m.SubmitStore(4, w, 1, pack_ids(range(3)), plan.slots))
    assert run(svc, m.SubmitStore(5, w, 2, pack_ids(range(2)), plan.slots[:16]), s).success


def test_parts_need_a_canonical_namespace(svc: Service) -> None:
    s = svc.open_session(1, os.getpid(), 0, 0)
    r = svc.handle(s, m.OpenNamespace(1, "ranks", m.KVLayout([LOCAL], world_size=2)))
    assert isinstance(r, m.NamespaceOpened)
    with pytest.raises(InvalidArgumentError, match="world size 1"):
        attach(svc, s, r.ns, shared_kv_cache(4, LOCAL), 0, 2, HALF(CANON, frags((0, 0, 8))))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 8),
    st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
)
def test_turns_cover_every_block_exactly_once(writers: int, f: int, slots: list[int]) -> None:
    """Whatever the slots and block size factor, the writers of one set of bytes
    together copy every block once (page ids slot * f + sub-block)."""
    part = CanonicalPart(64, np.array([[0, 0, 64]], dtype=np.int64))
    sub = np.tile(np.arange(f), len(slots))
    page_ids = np.repeat(np.asarray(slots, dtype=np.int64), f) * f + sub
    region = page_ids * 64
    cache = np.arange(page_ids.size, dtype=np.int64) * 64
    written: list[int] = []
    for w in range(writers):
        turn = CanonicalPart(64, part.frags, writers, w)
        r, _, n = expand(turn, region, cache, page_ids)
        written.extend((r // 64).tolist())
        assert (n == 64).all()
    assert sorted(written) == sorted(page_ids.tolist())


def test_a_slots_turn_key_is_memoized_per_workers_and_forgotten_when_one_goes() -> None:
    """The sealer keys a slot's coverage by its parts' workers and its turn: the turn
    period is worked out once per set of workers, and once a worker is gone no slot
    of it gets a key (nothing vouches for its copy), memo or not."""
    frags = np.array([[0, 0, 256]], dtype=np.int64)
    sealer = Sealer(None, itertools.count(1), {}, lambda index, slots: None)  # type: ignore[arg-type]
    layout = m.KVLayout(tensor_page_bytes=[512])
    sealer.add(1, place_caches(layout, [256], [CanonicalPart(512, frags, 2, 0)]))
    sealer.add(2, place_caches(layout, [256], [CanonicalPart(512, frags, 3, 1)]))
    assert sealer._key(7, 1, (1, 2)) == ((1, 2), 7 % 6)
    assert sealer._key(8, 2, (1, 2)) == ((1, 2), 16 % 6)  # from the memo
    sealer.remove(2)
    assert sealer._key(7, 1, (1, 2)) is None
