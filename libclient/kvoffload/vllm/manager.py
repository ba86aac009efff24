"""vLLM's OffloadingManager (scheduler side), backed by a kvoffloadd namespace.

Rules:
- Every answer is local (``kvoffload.view.EngineView``): lookups, store plans from
  leased slots, load plans from the mirrored slots, completions. What changed goes to
  the daemon once per scheduler step, one-way, at ``on_schedule_end`` (and from
  ``has_pending_work`` when the engine idles after its last completions). A blocking
  round trip remains only as the fallback of an empty lease pool, counted in
  ``blocking_calls_total``.
- With secondary tiers below the daemon's region, a mirror MISS asks further
  (``kvoffload.tierprobe``): a block on disk or in Redis is promoted into the region
  and answers RETRY until it is there (one round trip per key the mirror misses).
- A kvoffloadd fault never reaches vLLM: while the daemon is away, lookups MISS and
  stores have nothing to do (an empty plan); a store the worker could not make is
  never committed (later lookups miss). Load plans carry their keys and the store
  plans the engine's lease token, so the worker can complete them whatever happened
  to the daemon meanwhile (``kvoffload.streaming``).
- Events: with vLLM's KV events enabled, ``take_events`` reports the namespace's
  stores and evictions, by this engine and by every engine sharing the pool: each of
  them can load those blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence

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

from ..namespace import Namespace
from ..tierprobe import TierProbes
from ..view import EngineView, KeyState

log = logging.getLogger(__name__)

_RESULTS = {
    KeyState.MISS: LookupResult.MISS,
    KeyState.HIT: LookupResult.HIT,
    KeyState.HIT_PENDING: LookupResult.HIT_PENDING,
    KeyState.RETRY: LookupResult.RETRY,
}


class SlotsSpec(CPULoadStoreSpec):
    """Region slots of a store or load, with what the worker needs to complete it
    whatever happened to the daemon: a load's keys, a store's lease token."""

    def __init__(self, slots: list[int], keys: Sequence[bytes] = (), lease: int = 0) -> None:
        super().__init__(slots)
        self.keys = list(keys)
        self.lease = lease


class KVOffloadManager(OffloadingManager):
    def __init__(self, ns: Namespace, enable_events: bool = False, lease_blocks: int = 64) -> None:
        self.ns = ns
        self.medium = Medium.CPU
        self.view = EngineView(ns, lease_blocks, keep_events=enable_events)
        self.enable_events = enable_events
        self.tiers = TierProbes(ns)  # used while the daemon reports secondary tiers

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        view = self.view
        state = view.lookup(key)
        # a key this engine is committing is in the region already, not in a tier
        if (
            state is KeyState.MISS
            and self.ns.tiers
            and view.connected
            and key not in view.committing
        ):
            state = self.tiers.lookup(key, req_context.req_id)
        return _RESULTS[state]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        return SlotsSpec(self.view.prepare_load(keys), keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.view.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.view.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.view.prepare_store(list(keys))
        if plan is None:
            return None
        todo, slots = plan
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in todo],
            store_spec=SlotsSpec(slots, lease=self.ns.lease),
            evicted_keys=[],  # the daemon evicts in the background; events report it
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.view.complete_store(list(keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self.ns.tiers:
            self.tiers.end_step()
        self.view.end_step()

    def has_pending_work(self) -> bool:
        self.view.flush()  # completions of the engine's last step, before it idles
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.enable_events:
            return ()
        events, self.view.events = self.view.events, []
        return [
            OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=self.medium, removed=r)
            for keys, r in events
        ]

    def reset_cache(self) -> None:
        """Forget this engine's view. The shared pool is left alone: other engines use
        it; give engines whose KV changed a new ``cache_salt`` instead."""
        log.info("namespace %s: reset_cache resyncs the key mirror", self.ns.name)
        self.view._resync = True
        self.tiers.forget()

    def shutdown(self) -> None:
        self.view.flush()
        self.ns.client.close()
