"""vLLM's OffloadingManager (scheduler side), backed by an engine's kvoffload namespaces.

Rules:
- One namespace per KV cache group and pipeline stage (``identity``), each mirrored by
  a ``kvoffload.engine.view.EngineView``; a key goes to its group's namespaces (vLLM's
  OffloadKey ends in its group). With several stages a key is HIT only when every
  stage holds it, and a store or a load plans a slot in each stage
  (``SlotsSpec.stage_slots``); a stage whose namespace is away or full gets none, and
  then none of them does (a block is only loadable whole).
- Every answer is local. What changed goes to the daemon one-way, in one frame per
  namespace, all in one write, and the pushes are read in one read right after it: at
  the end of a step (``on_schedule_end``), at most once per ``batch_interval_s``, so
  one step in an interval pays for the I/O and the rest none; at once when a lease
  pool runs low (then the next step's first call reads the grant too), and when the
  engine idles (``has_pending_work``). Pushes read at a step's end are what the next
  step sees. A connection the client rebuilt in the background is adopted at every
  step's first call. A blocking round trip remains only as the fallback of an empty
  lease pool, counted in ``blocking_calls_total``.
- With secondary tiers below the daemon's region, a mirror MISS asks further
  (``kvoffload.engine.tierprobe``): a block on disk or in Redis is promoted into the region
  and answers RETRY until it is there (one round trip per key the mirror misses).
- A kvoffloadd fault never reaches vLLM: while the daemon is away, lookups MISS and
  stores have nothing to do (an empty plan); a store the worker could not make is
  never committed (later lookups miss). Load plans carry their keys and the store
  plans the engine's lease tokens, so the workers can complete them whatever happened
  to the daemon meanwhile (``kvoffload.engine.streaming``).
- Events: with vLLM's KV events enabled, ``take_events`` reports the namespaces'
  stores and evictions, by this engine and by every engine sharing the pool (each of
  them can load those blocks); with several stages, a store once every stage holds
  the key, a removal once any dropped it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.engine.tierprobe import TierProbes
from kvoffload.engine.view import EngineView, KeyState
from kvoffload.link.channel import Channel
from kvoffload.namespace import Namespace

log = logging.getLogger(__name__)

# How often at most a step writes to the daemon and reads its pushes (the default of
# the spec's ``batch_interval_s``). An I/O step costs the scheduler ~0.1-0.3 ms, most of
# it whatever it carries (two system calls with cold caches, the pushes applied): at
# 20 ms that is at most ~1% of the engine's time, and steps of 3-5 ms do I/O in about
# one step in five, so the median step is one without it. The price: other engines see
# a store up to that much later, and the lease pool holds that much more of the region.
BATCH_INTERVAL_S = 0.02

_RESULTS = {
    KeyState.MISS: LookupResult.MISS,
    KeyState.HIT: LookupResult.HIT,
    KeyState.HIT_PENDING: LookupResult.HIT_PENDING,
    KeyState.RETRY: LookupResult.RETRY,
}
# Several stages answer together: the first of these any stage gives.
_WORST = (KeyState.MISS, KeyState.RETRY, KeyState.HIT_PENDING, KeyState.HIT)


class SlotsSpec(CPULoadStoreSpec):
    """Region slots of a store or load, with what the workers need to complete it
    whatever happened to the daemon: the keys, and for stores the lease tokens.

    ``stage_slots[s][i]`` is the slot of ``keys[i]`` in its group's namespace of
    pipeline stage ``s`` (-1: that stage holds the key already, or, for a load, the
    slot is not known and the load reads by key); ``leases[s][g]`` the engine's lease
    token in group ``g``'s namespace of stage ``s``. ``block_ids`` are stage 0's.
    """

    def __init__(
        self,
        keys: Sequence[bytes],
        stage_slots: Sequence[Sequence[int]],
        leases: Sequence[Sequence[int]] = (),
    ) -> None:
        super().__init__(list(stage_slots[0]) if stage_slots else [])
        self.keys = list(keys)
        self.stage_slots = [list(s) for s in stage_slots]
        self.leases = [list(t) for t in leases]


class KVOffloadManager(OffloadingManager):
    def __init__(
        self,
        namespaces: Sequence[Sequence[Namespace]],
        group_ids: Sequence[int],
        enable_events: bool = False,
        lease_blocks: int = 64,
        batch_interval_s: float = BATCH_INTERVAL_S,
    ) -> None:
        """``namespaces[g][s]``: KV cache group ``g``'s namespace of stage ``s``, on
        one connection; ``group_ids[g]``: vLLM's id of the group (its keys' suffix)."""
        self.namespaces = [list(per) for per in namespaces]
        self.ns = self.namespaces[0][0]
        self.client: Channel = self.ns.client
        self.medium = Medium.CPU
        self.enable_events = enable_events
        self.batch_interval_s = batch_interval_s
        self.stages = len(self.namespaces[0])
        self.group_views = [
            [EngineView(ns, lease_blocks, keep_events=enable_events) for ns in per]
            for per in self.namespaces
        ]
        self.views = [v for per in self.group_views for v in per]
        self._by_suffix = {g.to_bytes(4, "big"): v for g, v in zip(group_ids, self.group_views)}
        self.view = self.views[0]
        self.tiers = {id(v): TierProbes(v.ns) for v in self.views}  # used with tiers only
        self._in_step = False
        self._io_at = 0.0  # the next step end that writes and reads
        self.clock: Callable[[], float] = time.monotonic  # what the interval is read on
        self._stored: set[bytes] = set()  # several stages: keys reported stored
        self._single = len(self.views) == 1

    # ------------------------------------------------------------ step I/O

    @property
    def blocking_calls_total(self) -> int:
        return sum(v.blocking_calls_total for v in self.views)

    @property
    def connected(self) -> bool:
        return all(v.connected for v in self.views)

    def _begin(self) -> None:
        """A step's first call: adopt a new connection; read the grant a low lease
        pool asked for at the last step's end."""
        self._in_step = True
        self.client.adopt()
        if any(v.low for v in self.views):
            self.client.poll()
        for v in self.views:
            v.begin_step(poll=False)

    def _end(self) -> None:
        """The step's end: when due, its batches go out in one write and the pushes
        that arrived are read in one read."""
        if not self._in_step:
            self._begin()
        self._in_step = False
        now = self.clock()
        due = now >= self._io_at or any(v.low for v in self.views)
        for v in self.views:
            v.end_step(flush=False)
            if due:
                v.flush(send=False)
        if due:
            self._io_at = now + self.batch_interval_s
            self.client.poll()  # writes what is queued, then reads

    def _runs(self, keys: Sequence[bytes]) -> list[tuple[list[EngineView], list[bytes]]]:
        """Consecutive keys of one group: (the group's stage views, the keys)."""
        out: list[tuple[list[EngineView], list[bytes]]] = []
        by_suffix, last = self._by_suffix, b""
        for key in keys:
            suffix = key[-4:]
            if suffix != last or not out:
                out.append((by_suffix[suffix], []))
                last = suffix
            out[-1][1].append(key)
        return out

    # ------------------------------------------------------------ the contract

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._in_step:
            self._begin()
        if self._single:
            return _RESULTS[self._state(self.view, key, req_context)]
        views = self._by_suffix[key[-4:]]
        states = {self._state(v, key, req_context) for v in views}
        return _RESULTS[next(s for s in _WORST if s in states)]

    def _state(self, view: EngineView, key: bytes, req_context: ReqContext) -> KeyState:
        state = view.lookup(key)
        # a key this engine is committing is in the region already, not in a tier
        if (
            state is KeyState.MISS
            and view.ns.tiers
            and view.connected
            and key not in view.committing
        ):
            state = self.tiers[id(view)].lookup(key, req_context.req_id)
        return state

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        if not self._in_step:
            self._begin()
        keys = list(keys)
        stage_slots: list[list[int]] = [[] for _ in range(self.stages)]
        for views, run in self._runs(keys):
            for s, v in enumerate(views):
                stage_slots[s].extend(v.prepare_load(run))
        return SlotsSpec(keys, stage_slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for views, run in self._runs(list(keys)):
            for v in views:
                v.touch(run)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for views, run in self._runs(list(keys)):
            for v in views:
                v.complete_load(run)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if not self._in_step:
            self._begin()
        Plan = tuple[list[bytes], list[int]]
        planned: list[tuple[list[EngineView], list[Plan], list[bytes]]] = []
        for views, run in self._runs(list(keys)):
            if len(views) > 1 and not all(v.connected for v in views):
                continue  # a stage is away: a block of this group would not be whole
            plans = [v.prepare_store(run) for v in views]
            done = [p for p in plans if p is not None]
            if len(done) < len(plans):  # no space: nothing of this call happens
                for v, p in zip(views, plans):
                    if p is not None and p[0]:
                        v.complete_store(p[0], success=False)
                for vs, ps, _ in planned:
                    for v, p in zip(vs, ps):
                        if p[0]:
                            v.complete_store(p[0], success=False)
                return None  # vLLM counts it and asks again later
            planned.append((views, done, run))
        todo: list[bytes] = []
        stage_slots: list[list[int]] = [[] for _ in range(self.stages)]
        for views, plans_g, run in planned:
            if len(views) == 1:
                todo += plans_g[0][0]
                stage_slots[0] += plans_g[0][1]
                continue
            where = [dict(zip(k, sl)) for k, sl in plans_g]
            new = [k for k in dict.fromkeys(run) if any(k in w for w in where)]
            todo += new
            for s, w in enumerate(where):
                stage_slots[s] += [w.get(k, -1) for k in new]
        leases = [[per[s].ns.lease for per in self.group_views] for s in range(self.stages)]
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in todo],
            store_spec=SlotsSpec(todo, stage_slots, leases),
            evicted_keys=[],  # the daemon evicts in the background; events report it
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        for views, run in self._runs(list(keys)):
            for v in views:
                v.complete_store(run, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        for v in self.views:
            if v.ns.tiers:
                self.tiers[id(v)].end_step()
        self._end()

    def has_pending_work(self) -> bool:
        """The engine is going idle: what its last steps changed goes out now."""
        for v in self.views:
            v.flush(send=False)
        self.client.flush()
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.enable_events:
            return ()
        out = [
            OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=self.medium, removed=r)
            for keys, r in self._events()
        ]
        return out

    def _events(self) -> list[tuple[list[bytes], bool]]:
        if self.stages == 1:
            events = [e for v in self.views for e in v.events]
            for v in self.views:
                v.events = []
            return events
        out: list[tuple[list[bytes], bool]] = []
        stored = self._stored
        for views in self.group_views:
            for v in views:
                for keys, removed in v.events:
                    if removed:
                        gone = [k for k in keys if k in stored]
                        stored.difference_update(gone)
                        if gone:
                            out.append((gone, True))
                    else:
                        whole = [
                            k for k in keys if k not in stored and all(k in w.ready for w in views)
                        ]
                        stored.update(whole)
                        if whole:
                            out.append((whole, False))
                v.events = []
        return out

    def reset_cache(self) -> None:
        """Forget this engine's view. The shared pool is left alone: other engines use
        it; give engines whose KV changed a new ``cache_salt`` instead."""
        log.info("kvoffload: reset_cache resyncs the key mirrors")
        for v in self.views:
            v._resync = True
        for probes in self.tiers.values():
            probes.forget()

    def shutdown(self) -> None:
        self.has_pending_work()
        self.client.close()
