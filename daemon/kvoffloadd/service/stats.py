"""Stats: one pure function turns the daemon's state into named sections.

The admin ``stats`` reply, the metrics endpoint and the fatal-error log all use
``render_stats``, so they can never disagree. Field names are snake_case with their
unit (``_bytes``, ``_s``, ``_total`` for counters). Over the socket a peer sees the
sections of the namespaces it may open only (``stats_for``, ``clients_for``); admins
see all.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvoffload.protocol.messages import ClientInfo

if TYPE_CHECKING:  # types only; none of these imports this module
    from kvoffloadd.access import AccessPolicy, Peer
    from kvoffloadd.config import DaemonConfig
    from kvoffloadd.copies.gpu import GpuRuntime
    from kvoffloadd.copies.workers import AttachedWorker
    from kvoffloadd.index.index import NamespaceIndex
    from kvoffloadd.ledger import Ledger
    from kvoffloadd.region.region import SharedOffloadRegion
    from kvoffloadd.service.budgets import Budgets
    from kvoffloadd.service.engines import EngineChannel
    from kvoffloadd.service.session import Session
    from kvoffloadd.service.transfers import Transfers
    from kvoffloadd.tiers.tiering import Tiering


class Service(Protocol):
    """What the stats read of the service (service.py implements it)."""

    config: DaemonConfig
    access: AccessPolicy
    region: SharedOffloadRegion
    namespaces: dict[int, NamespaceIndex]
    sessions: dict[int, Session]
    transfers: Transfers
    engines: EngineChannel
    tiering: Tiering | None
    gpu: GpuRuntime | None
    gpu_unavailable: str
    budgets: Budgets
    ledger: Ledger
    loop: LoopTurns
    errors_by_code: dict[str, int]
    requests_total: int
    shutting_down: bool
    started_s: float

    @property
    def inflight_jobs(self) -> int: ...

    @property
    def workers(self) -> dict[int, AttachedWorker]: ...


def render_stats(svc: Service) -> dict[str, Any]:
    g = svc.region.geometry
    pool = svc.region.pool
    # vars(), not dataclasses.asdict: that deep-copies every field (7 ms for 64 namespaces)
    namespaces = {ns.name: dict(vars(ns.statistics())) for ns in svc.namespaces.values()}
    used_blocks = sum(n["stored_blocks"] + n["writing_blocks"] for n in namespaces.values())

    def total(field: str) -> int:
        return sum(int(n[field]) for n in namespaces.values())

    return {
        "server": {
            "version": _version(),
            "instance": svc.config.instance,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - svc.started_s, 3),
            "socket": svc.config.socket_path,
            "requests_total": svc.requests_total,
            "shutting_down": svc.shutting_down,
        },
        "region": {
            "name": svc.region.name,
            "region_bytes": g.region_bytes,
            "data_bytes": g.num_extents * g.extent_bytes,
            "extent_bytes": g.extent_bytes,
            "extents_total": g.num_extents,
            "extents_free": pool.num_free,
            "prefaulted_bytes": svc.region.prefaulted_bytes,
            **svc.region.statistics(),
        },
        "numa_nodes": svc.region.node_statistics(),
        "blocks": {
            "namespaces": len(namespaces),
            "used_blocks": used_blocks,
            "used_bytes": sum(
                (n["stored_blocks"] + n["writing_blocks"]) * n["slot_bytes"]
                for n in namespaces.values()
            ),
            "occupancy_ratio": round(1 - pool.num_free / g.num_extents, 4),
            "hit_keys_total": total("hit_keys_total"),
            "miss_keys_total": total("miss_keys_total"),
            "lookup_keys_total": total("lookup_keys_total"),
            "stored_blocks_total": total("stored_blocks_total"),
            "loads_prepared_total": total("loads_prepared_total"),
        },
        "eviction": {
            "policy": svc.config.policy,
            "evicted_blocks_total": total("evicted_blocks_total"),
            "store_failures_total": total("store_failures_total"),
            "no_space_total": svc.errors_by_code.get("NO_SPACE", 0),
            "events_dropped_total": total("events_dropped_total"),
        },
        "tiers": svc.tiering.statistics() if svc.tiering else {"configured": 0},
        "namespaces": namespaces,
        "clients": {
            "connected": len(svc.sessions),
            "workers": len(svc.workers),
        },
        "copies": {
            "inflight_jobs": svc.inflight_jobs,
            "failed_jobs_total": svc.transfers.jobs_failed,
            "stored_bytes_total": svc.transfers.bytes_stored,
            "loaded_bytes_total": svc.transfers.bytes_loaded,
            "store_seconds_total": round(svc.transfers.store_seconds, 6),
            "load_seconds_total": round(svc.transfers.load_seconds, 6),
            "planned_pages_total": svc.transfers.pages_planned,
            "planned_runs_total": svc.transfers.runs_planned,
        },
        "gpu": gpu_stats(svc),
        "loop": svc.loop.summary(),
        "budgets": dataclasses.asdict(svc.budgets.statistics()),
        "ledger": {
            "heap_bytes": svc.ledger.heap_bytes(),
            "worst_heap_bytes": svc.ledger.worst_heap_bytes(),
            "lines": svc.ledger.statistics(),
        },
        "engines": {
            "refused_claims_total": svc.engines.refused_claims_total,
            "leased_blocks": sum(n["leased_blocks"] for n in namespaces.values()),
            "pins_missed_total": total("pins_missed_total"),
            "duplicate_stores_total": total("duplicate_stores_total"),
        },
        "errors": dict(sorted(svc.errors_by_code.items())),
    }


class LoopTurns:
    """How long the loop thread works per turn (everything but waiting in select):
    what another client may wait behind one turn. A ring of the latest turns; a turn's
    record is a few stores (it runs on every turn of the loop)."""

    SAMPLES = 4096  # a power of two: the ring's position is the count of turns, masked
    # the kvoffload_loop_turn_seconds histogram's upper bounds (seconds)
    BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

    def __init__(self) -> None:
        self._s = [0.0] * self.SAMPLES
        self.turns_total = 0
        self.max_s = 0.0
        self.sum_s = 0.0
        self._counts = [0] * (len(self.BUCKETS_S) + 1)  # per bucket; the last: above all
        # Start-up objects frozen out of the collector, counted once by main():
        # gc.get_freeze_count() walks all ~32,000, and made every stats call 407 us, not 62.
        self.frozen_objects = 0

    def record(self, seconds: float) -> None:
        n = self.turns_total
        self._s[n & (self.SAMPLES - 1)] = seconds
        self.turns_total = n + 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds
        self._counts[bisect.bisect_left(self.BUCKETS_S, seconds)] += 1

    def histogram(self) -> tuple[list[tuple[float, int]], float]:
        """Cumulative counts per upper bound (the last one +inf), and the sum."""
        out, n = [], 0
        for le, count in zip((*self.BUCKETS_S, float("inf")), self._counts):
            n += count
            out.append((le, n))
        return out, self.sum_s

    def summary(self) -> dict[str, Any]:
        n = min(self.turns_total, self.SAMPLES)
        recent = sorted(self._s[:n]) if n else [0.0]
        return {
            "turns_total": self.turns_total,
            "turn_p50_us": round(recent[len(recent) // 2] * 1e6, 1),
            "turn_p99_us": round(recent[min(len(recent) - 1, len(recent) * 99 // 100)] * 1e6, 1),
            "turn_max_us": round(self.max_s * 1e6, 1),
            "gc_frozen_objects": self.frozen_objects,
            "turn_seconds_buckets": [
                ["+Inf" if le == float("inf") else le, n] for le, n in self.histogram()[0]
            ],
            "turn_seconds_sum": round(self.sum_s, 6),
        }


def gpu_stats(svc: Service) -> dict[str, Any]:
    gpu = svc.gpu
    if gpu is None:
        return {"enabled": False, "reason": svc.gpu_unavailable}
    batched, looped = gpu.lane_counts()
    kernel_jobs, kernel_bytes = gpu.kernel_counts()
    return {
        "enabled": True,
        "devices": gpu.describe(),
        "batched_copies": gpu.api.has_batch,
        "open_ipc_handles": gpu.open_handles,
        **gpu.pinner.statistics(),
        "batched_jobs_total": batched,
        "looped_jobs_total": looped,
        "kernel_mode": gpu.kernel_mode,
        "kernel_jobs_total": kernel_jobs,
        "kernel_bytes_total": kernel_bytes,
        "copy_paths": {str(i): p.describe() for i, p in sorted(gpu.paths.items())},
    }


def stats_for(svc: Service, peer: Peer) -> dict[str, Any]:
    """Every figure; per-namespace sections only of namespaces the peer may open (all
    of them for admins): a name tells whose model runs on the node."""
    stats = render_stats(svc)
    if not svc.access.may_administer(peer):
        mine = svc.access.may_open
        stats["namespaces"] = {k: v for k, v in stats["namespaces"].items() if mine(peer, k)}
        lines = stats["ledger"]["lines"]  # who holds what is for admins
        stats["ledger"]["lines"] = {n: {**v, "by_uid": {}} for n, v in lines.items()}
    return stats


def clients_for(svc: Service, peer: Peer) -> list[ClientInfo]:
    """The client list, naming only namespaces the peer may open (admins: all)."""
    infos = client_infos(svc)
    if svc.access.may_administer(peer):
        return infos
    mine = svc.access.may_open
    return [
        msgspec.structs.replace(c, namespaces=[n for n in c.namespaces if mine(peer, n)])
        for c in infos
    ]


def client_infos(svc: Service) -> list[ClientInfo]:
    out = []
    for s in svc.sessions.values():
        ns = [svc.namespaces[i] for i in sorted(s.namespaces)]
        out.append(
            ClientInfo(
                client_id=s.session_id,
                pid=s.pid,
                uid=s.uid,
                name=s.name,
                namespaces=[n.name for n in ns],
                workers=len(s.workers),
                pinned_blocks=sum(n.pinned_by(s.session_id) for n in ns),
                writing_blocks=sum(n.writing_by(s.session_id) for n in ns),
                inflight_jobs=sum(len(svc.workers[w].active_jobs) for w in s.workers),
                bytes_stored=s.bytes_stored,
                bytes_loaded=s.bytes_loaded,
            )
        )
    return out


def _version() -> str:
    from kvoffloadd import __version__

    return __version__
