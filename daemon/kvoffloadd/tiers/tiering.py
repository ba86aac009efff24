"""Tiering: stores cascade from the region to the secondary tiers, misses promote back.

The semantics are those of vLLM's multi-tier offloading (research/vllm_kv_offload.md
section 8):

- A store that completes in the region is queued for every tier that lacks the block.
  Engines never wait for it. When a tier takes the job, the block is pinned in the
  region (``TIER_CLIENT`` holds the pin) until the tier has read it, so eviction cannot
  take the slot under the copy; a block evicted while still queued is skipped.
- A lookup that misses the region looks further down: the leading keys that some tier
  holds are promoted into region slots (``prepare_store`` for ``TIER_CLIENT``; the slot
  is "being written" and so pinned) and the lookup answers ``None``, "ask again
  later", until they are ready. One lookup's keys go to each tier together, in as
  many jobs as the tier runs at once (``promotion_jobs``: a disk tier one, spread over
  its promotion threads; a Redis tier one per connection), each of at most
  ``MAX_PROMOTION_JOB_BLOCKS``: every job costs the loop its completion.
- A promoted block completes like any store: it becomes visible, is announced, and
  cascades to the tiers that lack it (not back to its source).
- A failed tier transfer is counted and logged; a failed promotion frees its slot and
  the key misses. Stores that complete while a tier is unhealthy (unreachable) are not
  queued for it: they would only pin region slots until their copies time out.
  Region eviction never removes a block from a tier, nor does dropping a namespace
  (the table's or an admin's): a tier's blocks are keyed by the namespace's name and
  layout, so a namespace of that name and layout created again finds them, one of
  another layout never does, and the tier's own capacity bounds them.
- A tier with a job older than ``job_timeout_s`` (a hung disk, a stuck server) is
  *stalled*: it gets no new promotions or cascades and its keys miss, until its late
  jobs finish. Their region slots stay pinned meanwhile, since a tier thread may still
  touch them; at most ``max_inflight_blocks`` per tier, so the fault stays in its tier.

Everything here runs on the loop thread; the tiers' threads only move bytes.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.protocol.errors import QuotaExceededError
from kvoffload.protocol.messages import KEY_ABSENT as ABSENT
from kvoffload.protocol.messages import KEY_PROMOTING as PROMOTING
from kvoffload.protocol.messages import KEY_READY as READY
from kvoffloadd.index.index import NamespaceIndex
from kvoffloadd.tiers.base import SecondaryTier, TierJob, TierNamespace, WakeFd

log = logging.getLogger(__name__)

TIER_CLIENT = -1  # owner of the daemon's own pins and writes in the index
MAX_PROMOTION_JOB_BLOCKS = 256  # blocks of one promotion job at most


def promotion_parts(n: int, jobs: int) -> list[range]:
    """``n`` keys of one lookup, for a tier that runs ``jobs`` jobs at once: that many
    parts (fewer for fewer keys, more for parts past ``MAX_PROMOTION_JOB_BLOCKS``), of
    sizes that differ by one at most."""
    if n <= 0:
        return []
    count = max(min(max(1, jobs), n), -(-n // MAX_PROMOTION_JOB_BLOCKS))
    size, extra = divmod(n, count)
    out, at = [], 0
    for i in range(count):
        step = size + (i < extra)
        out.append(range(at, at + step))
        at += step
    return out


@dataclass
class _TierState:
    tier: SecondaryTier
    backlog: deque[tuple[int, bytes]] = field(default_factory=deque)  # (ns id, key)
    inflight_blocks: int = 0
    found_keys_total: int = 0  # lookups that found a key here
    promoted_blocks_total: int = 0
    promotion_failures_total: int = 0
    # time.monotonic() (CLOCK_MONOTONIC: one clock for every process on the host) when
    # the loop last finished a promotion job here (its good blocks ready; 0: never)
    last_promotion_done_s: float = 0.0
    cascade_dropped_total: int = 0  # backlog full, tier unhealthy, or evicted first
    stalled: bool = False  # a job ran past job_timeout_s and has not finished
    stalls_total: int = 0

    @property
    def usable(self) -> bool:
        return self.tier.healthy and not self.stalled


@dataclass
class _Job:
    state: _TierState
    index: NamespaceIndex
    keys: list[bytes]
    buffers: list[memoryview]
    promotion: bool
    started_s: float


class Tiering:
    def __init__(
        self,
        tiers: list[SecondaryTier],
        wake: WakeFd,
        region_buffer: npt.NDArray[np.uint8],
        max_inflight_blocks: int = 256,
        max_backlog_blocks: int = 65_536,
        batch_blocks: int = 8,
        job_timeout_s: float = 30.0,
    ) -> None:
        self.job_timeout_s = job_timeout_s
        self.wake = wake
        self._tiers = [_TierState(t) for t in tiers]
        self._mem = memoryview(region_buffer.data)
        self._base_address = region_buffer.ctypes.data
        for t in tiers:
            t.attach_region(self._base_address, region_buffer.nbytes)
        self._max_inflight = max_inflight_blocks
        self._max_backlog = max_backlog_blocks
        self._batch = batch_blocks
        self._ns: dict[int, tuple[NamespaceIndex, TierNamespace]] = {}
        self._jobs: dict[int, _Job] = {}
        self._next_job = 1

    @property
    def count(self) -> int:
        return len(self._tiers)

    def busy_with(self, index: NamespaceIndex) -> int:
        """Blocks of ``index`` a tier's thread copies now (a cascade reads them, a
        promotion writes them): the namespace may not be dropped under them."""
        return sum(len(job.keys) for job in self._jobs.values() if job.index is index)

    def namespace_dropped(self, index: NamespaceIndex) -> None:
        """A namespace with no tier job in flight left the table: its queued cascades
        go with it. What the tiers hold of it stays theirs (see the module's rules)."""
        self._ns.pop(index.ns_id, None)
        for st in self._tiers:
            st.backlog = deque(x for x in st.backlog if x[0] != index.ns_id)

    def namespace_opened(self, index: NamespaceIndex) -> None:
        tns = TierNamespace.of(index.name, index.fingerprint, index.layout.block_bytes)
        self._ns[index.ns_id] = (index, tns)
        index.on_stored = functools.partial(self._on_stored, index)
        for st in self._tiers:
            st.tier.open_namespace(tns)

    # ------------------------------------------------------------ lookups, promotion

    def lookup(self, index: NamespaceIndex, keys: Sequence[bytes]) -> int | None:
        """Leading keys ready in the region, or ``None`` while some are promoted."""
        return self.lookup_rest(index, keys, index.lookup(keys))

    def lookup_rest(self, index: NamespaceIndex, keys: Sequence[bytes], hits: int) -> int | None:
        """``lookup`` once the region's ``hits`` leading keys are counted."""
        if hits == len(keys) or not self._tiers:
            return hits
        return None if PROMOTING in self.probe(index, keys[hits:]) else hits

    def probe(self, index: NamespaceIndex, keys: Sequence[bytes]) -> list[int]:
        """Per key READY, PROMOTING (started now or before) or ABSENT, up to and
        including the first ABSENT key; keys a tier holds start their promotion."""
        tns = self._ns[index.ns_id][1]
        states: list[int] = []
        found: list[tuple[bytes, _TierState]] = []
        first_found = 0  # index in states of found[0]
        lead = index.ready_prefix(keys)  # the leading ready keys at C speed
        states.extend([READY] * lead)
        for key in keys[lead:]:
            if index.is_ready(key):
                states.append(READY)
                continue
            writer = index.writer_of(key)
            if writer == TIER_CLIENT:  # being promoted already
                states.append(PROMOTING)
                continue
            src = None
            if writer is None:  # else an engine's store is in flight: not ours
                src = next(
                    (st for st in self._tiers if st.usable and st.tier.lookup(tns, [key])[0]),
                    None,
                )
            if src is None:
                states.append(ABSENT)
                break
            src.found_keys_total += 1
            if not found:
                first_found = len(states)
            found.append((key, src))
            states.append(PROMOTING)
        if found and not self._promote(index, tns, found):
            del states[first_found + 1 :]  # no room: the first key to promote misses
            states[first_found] = ABSENT
        return states

    def _promote(
        self, index: NamespaceIndex, tns: TierNamespace, found: list[tuple[bytes, _TierState]]
    ) -> bool:
        try:
            plan = index.prepare_store([k for k, _ in found], TIER_CLIENT)
        except QuotaExceededError:
            plan = None
        if plan is None or not plan.keys_to_store:
            return False
        slot_of = dict(zip(plan.keys_to_store, plan.slots))
        for st in self._tiers:
            keys = [k for k, src in found if src is st]
            for part in promotion_parts(len(keys), st.tier.promotion_jobs):
                ks = keys[part.start : part.stop]
                job = self._job(st, index, tns, ks, [slot_of[k] for k in ks], True)
                st.tier.submit_load(job)
        return True

    # ------------------------------------------------------------ cascade

    def _on_stored(self, index: NamespaceIndex, keys: list[bytes]) -> None:
        tns = self._ns[index.ns_id][1]
        for st in self._tiers:
            for key, have in zip(keys, st.tier.lookup(tns, keys)):
                if have:
                    continue
                if len(st.backlog) >= self._max_backlog or not st.usable:
                    st.cascade_dropped_total += 1
                    continue
                st.backlog.append((index.ns_id, key))
        self.dispatch()

    def dispatch(self) -> None:
        """Start cascades while each tier has room for more blocks in flight."""
        for st in self._tiers:
            while st.backlog and st.inflight_blocks < self._max_inflight and not st.stalled:
                ns_id = st.backlog[0][0]
                keys: list[bytes] = []
                while st.backlog and st.backlog[0][0] == ns_id and len(keys) < self._batch:
                    keys.append(st.backlog.popleft()[1])
                index, tns = self._ns[ns_id]
                lacking = [k for k, have in zip(keys, st.tier.lookup(tns, keys)) if not have]
                pinned = index.pin_ready(lacking, TIER_CLIENT)
                st.cascade_dropped_total += len(lacking) - len(pinned)
                if pinned:
                    ks = [k for k, _ in pinned]
                    job = self._job(st, index, tns, ks, [s for _, s in pinned], False)
                    st.tier.submit_store(job)

    def _job(
        self,
        st: _TierState,
        index: NamespaceIndex,
        tns: TierNamespace,
        keys: list[bytes],
        slots: list[int],
        promotion: bool,
    ) -> TierJob:
        offsets = index.slots.region_offsets(np.asarray(slots, dtype=np.int64)).tolist()
        n = tns.block_bytes
        buffers = [self._mem[off : off + n] for off in offsets]
        job_id, self._next_job = self._next_job, self._next_job + 1
        self._jobs[job_id] = _Job(st, index, keys, buffers, promotion, time.monotonic())
        st.inflight_blocks += len(keys)
        addresses = [self._base_address + off for off in offsets]
        return TierJob(job_id, tns, keys, buffers, addresses)

    # ------------------------------------------------------------ completions

    def on_wake(self) -> None:
        self.wake.clear()
        for st in self._tiers:
            for result in st.tier.get_finished():
                job = self._jobs.pop(result.job_id)
                st.inflight_blocks -= len(job.keys)
                for b in job.buffers:
                    b.release()
                if job.promotion:
                    self._promoted(job, result.ok)
                else:
                    job.index.complete_load(job.keys, TIER_CLIENT)  # unpin
        self.dispatch()

    def check_stalls(self, now_s: float) -> None:
        """Stall a tier whose oldest job is overdue; resume it once none is (cron)."""
        for st in self._tiers:
            oldest = min((j.started_s for j in self._jobs.values() if j.state is st), default=now_s)
            overdue = now_s - oldest > self.job_timeout_s
            if overdue and not st.stalled:
                st.stalls_total += 1
                log.warning(
                    "tier %s: a job has run for %.0f s (over %.0f s); the tier is stalled "
                    "(its keys miss, nothing new is sent to it) until its jobs finish",
                    st.tier.name,
                    now_s - oldest,
                    self.job_timeout_s,
                )
            elif st.stalled and not overdue:
                log.warning("tier %s: its late jobs finished; it is used again", st.tier.name)
            st.stalled = overdue

    def _promoted(self, job: _Job, ok: list[bool]) -> None:
        index = job.index
        good = [k for k, o in zip(job.keys, ok) if o]
        bad = [k for k, o in zip(job.keys, ok) if not o]
        job.state.promoted_blocks_total += len(good)
        job.state.promotion_failures_total += len(bad)
        if bad:
            log.warning(
                "tier %s: %d of %d blocks could not be promoted into %s; they miss",
                job.state.tier.name,
                len(bad),
                len(job.keys),
                index.name,
            )
            index.complete_store(bad, False, TIER_CLIENT)
        if good:
            slots = index.slots_of(good)
            for rank in range(index.layout.world_size):
                index.mark_written(slots, rank)
            index.complete_store(good, True, TIER_CLIENT)
        job.state.last_promotion_done_s = time.monotonic()

    # ------------------------------------------------------------ admin

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"configured": len(self._tiers)}
        for st in self._tiers:
            s = st.tier.statistics()
            s.update(
                found_keys_total=st.found_keys_total,
                promoted_blocks_total=st.promoted_blocks_total,
                promotion_failures_total=st.promotion_failures_total,
                last_promotion_done_s=st.last_promotion_done_s,
                promoting_blocks=sum(
                    len(j.keys) for j in self._jobs.values() if j.state is st and j.promotion
                ),
                cascade_backlog_blocks=len(st.backlog),
                cascade_inflight_blocks=sum(
                    len(j.keys) for j in self._jobs.values() if j.state is st and not j.promotion
                ),
                cascade_dropped_total=st.cascade_dropped_total,
                stalled=st.stalled,
                stalls_total=st.stalls_total,
            )
            s["healthy"] = s["healthy"] and not st.stalled
            out[st.tier.name] = s
        return out

    def close(self) -> None:
        """Stop the tiers (jobs still queued fail); the region views go."""
        for st in self._tiers:
            st.tier.close()
        for job in self._jobs.values():
            for b in job.buffers:
                b.release()
        self._jobs.clear()
        self._mem.release()
        self.wake.close()
