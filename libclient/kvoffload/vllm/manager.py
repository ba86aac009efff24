"""vLLM's OffloadingManager (scheduler side), backed by a kvoffloadd namespace.

Rules:
- ``lookup`` answers from a local key mirror (``kvoffload.mirror``): no round trip per
  key. HIT: stored and ready; HIT_PENDING: this engine's store is in flight; RETRY:
  the daemon is away and the client reconnecting; MISS otherwise.
- With secondary tiers below the daemon's region, a mirror MISS asks further
  (``kvoffload.tierprobe``): a block on disk or in Redis is promoted into the region
  and answers RETRY until it is there; the keys that follow in the same request are
  promoted together at the end of the scheduler step.
- Everything else is one daemon call, with vLLM's CPU manager semantics (the daemon's
  index implements them): ``prepare_store`` may evict, never its own keys, and gives
  None when nothing can be evicted; ``complete_store(success=False)`` drops unready
  keys; ``prepare_load`` pins.
- Another engine may evict a block between this engine's HIT and its
  ``prepare_load`` (the mirror is at most ``max_age_s`` behind and refreshed every
  scheduler step). The daemon keeps such a block loadable until this mirror has seen
  the eviction (kvoffloadd.graves), so the load reads the block's own bytes. Only if
  ``prepare_load`` comes more than the daemon's ``mirror_grace_s`` later does it fail:
  it then returns a spec marked failed, whose load the worker reports as failed; no
  byte of another block is ever loaded (DESIGN.md invariant 3).
- Events: with vLLM's KV events enabled, ``take_events`` reports the namespace's
  stores and evictions, by this engine and by every engine sharing the pool: each of
  them can load those blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

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

from ..client import Namespace
from ..mirror import KeyMirror, KeyState
from ..protocol.errors import KVOffloadError
from ..tierprobe import TierProbes

log = logging.getLogger(__name__)

_RESULTS = {
    KeyState.MISS: LookupResult.MISS,
    KeyState.HIT: LookupResult.HIT,
    KeyState.HIT_PENDING: LookupResult.HIT_PENDING,
    KeyState.RETRY: LookupResult.RETRY,
}


class SlotsSpec(CPULoadStoreSpec):
    """Region slots of a store or load; ``failed`` says why a load cannot run."""

    def __init__(self, slots: list[int], failed: str = "") -> None:
        super().__init__(slots)
        self.failed = failed


class KVOffloadManager(OffloadingManager):
    def __init__(
        self,
        ns: Namespace,
        enable_events: bool = False,
        max_age_s: float = 0.05,
        retry_s: float = 5.0,
    ) -> None:
        self.ns = ns
        self.medium = Medium.CPU
        self.mirror = KeyMirror(ns, max_age_s, retry_s, keep_events=enable_events)
        self.enable_events = enable_events
        self.stale_hits_total = 0
        self.tiers = TierProbes(ns)  # used while the daemon reports secondary tiers

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self.mirror.lookup(key)
        if state is KeyState.MISS and self.ns.tiers:
            state = self.tiers.lookup(key, req_context.req_id)
        return _RESULTS[state]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        try:
            return SlotsSpec(self.ns.prepare_load(keys).slots)
        except KVOffloadError as exc:
            self.stale_hits_total += 1
            log.error(
                "namespace %s: %d blocks looked up as hits cannot be loaded (%s); "
                "their load fails instead of loading other bytes",
                self.ns.name,
                len(keys),
                exc,
            )
            self.mirror.refresh()
            return SlotsSpec([], failed=str(exc))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.ns.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        try:
            self.ns.complete_load(list(keys))
        except KVOffloadError as exc:  # the load that failed in prepare_load pinned nothing
            log.debug("complete_load: %s", exc)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.ns.prepare_store(list(keys))
        if plan is None:
            return None
        self.mirror.stores_prepared(plan.keys_to_store, plan.evicted_keys)
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in plan.keys_to_store],
            store_spec=SlotsSpec(plan.slots),
            evicted_keys=[OffloadKey(k) for k in plan.evicted_keys],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        keys = list(keys)
        self.ns.complete_store(keys, success)
        self.mirror.stores_completed(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.tiers.end_step()
        self.mirror.refresh()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.enable_events:
            return ()
        self.mirror.refresh()
        events, self.mirror.events = self.mirror.events, []
        return [
            OffloadingEvent(keys=[OffloadKey(k) for k in keys], medium=self.medium, removed=r)
            for keys, r in events
        ]

    def reset_cache(self) -> None:
        """Forget this engine's view. The shared pool is left alone: other engines use
        it; give engines whose KV changed a new ``cache_salt`` instead."""
        log.info("namespace %s: reset_cache resyncs the key mirror", self.ns.name)
        self.mirror.clear()
        self.tiers.forget()

    def shutdown(self) -> None:
        self.ns.client.close()
