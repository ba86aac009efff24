"""Optional Prometheus endpoint (``metrics_port``), fed from the loop's stats snapshot,
with the health probes an orchestrator needs.

Rules:
- The HTTP server (httpd.py: one thread, bounded connections and time) never touches
  daemon metadata: the loop thread publishes an immutable ``render_stats`` snapshot and
  its health at start and at each cron tick, and handlers read only the latest ones (a
  reference swap). Every series is there from the first scrape. ``/metrics`` is
  rendered once per publication: a peer asking in a loop costs a copy, not a render.
- ``/healthz``: 200 while the loop turns (its last publication is recent), 503 with
  the reason otherwise. ``/readyz``: 200 once serving with the region pre-faulted and
  GPU pinning finished (or failed, which is reported), 503 with what is pending.
- Namespace names are labels only with ``metrics_namespace_labels``: the port is open
  to every local user, and a namespace's name says whose model it is. Without it the
  per-namespace series are summed under ``namespace="all"``.
- Names follow Prometheus conventions: ``kvoffload_`` prefix, base units (bytes,
  seconds), ``_total`` for counters.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvoffload.protocol.errors import ErrorCode
from kvoffloadd.server.httpd import HttpServer

log = logging.getLogger(__name__)

_NS_COUNTERS = [
    ("lookup_keys_total", "Keys asked for by lookups.", "lookup_keys"),
    ("hit_keys_total", "Keys found stored and ready by lookups.", "hit_keys"),
    ("miss_keys_total", "Keys asked for by lookups and not found ready.", "miss_keys"),
    ("stored_blocks_total", "Blocks whose store completed.", "stored_blocks"),
    ("evicted_blocks_total", "Blocks evicted.", "evicted_blocks"),
    (
        "store_failures_total",
        "Stores completed with success=False or failed by a dead client.",
        "store_failures",
    ),
    ("loads_prepared_total", "Blocks pinned for loading.", "loads_prepared_blocks"),
]


class StatsCollector(Collector):
    def __init__(self, namespace_labels: bool = False) -> None:
        self.snapshot: dict[str, Any] | None = None
        self.rates: dict[str, float] = {}
        self.namespace_labels = namespace_labels

    def publish(self, stats: dict[str, Any], rates: dict[str, float]) -> None:
        self.snapshot, self.rates = stats, rates

    def _namespaces(self, s: dict[str, Any]) -> dict[str, dict[str, Any]]:
        namespaces: dict[str, dict[str, Any]] = s["namespaces"]
        if self.namespace_labels:
            return namespaces
        fields = [f for f, _, _ in _NS_COUNTERS] + ["stored_blocks", "writing_blocks"]
        fields.append("pinned_blocks")
        return {"all": {f: sum(st[f] for st in namespaces.values()) for f in fields}}

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        namespaces = self._namespaces(s)
        for field, doc, name in _NS_COUNTERS:
            c = CounterMetricFamily(f"kvoffload_{name}", doc, labels=["namespace"])
            for ns, st in namespaces.items():
                c.add_metric([ns], st[field])
            yield c
        blocks = GaugeMetricFamily(
            "kvoffload_blocks", "Blocks in the region by state.", labels=["namespace", "state"]
        )
        for ns, st in namespaces.items():
            blocks.add_metric([ns, "stored"], st["stored_blocks"])
            blocks.add_metric([ns, "writing"], st["writing_blocks"])
            blocks.add_metric([ns, "pinned"], st["pinned_blocks"])
        yield blocks
        loop = s["loop"]
        yield HistogramMetricFamily(
            "kvoffload_loop_turn_seconds",
            "Loop time per turn (everything but waiting for input): what another client "
            "may wait behind one turn.",
            buckets=[(str(le), n) for le, n in loop["turn_seconds_buckets"]],
            sum_value=loop["turn_seconds_sum"],
        )
        copies = s["copies"]
        moved = CounterMetricFamily(
            "kvoffload_copied_bytes",
            "Bytes copied between engines and the region.",
            labels=["direction"],
        )
        moved.add_metric(["store"], copies["stored_bytes_total"])
        moved.add_metric(["load"], copies["loaded_bytes_total"])
        yield moved
        rate = GaugeMetricFamily(
            "kvoffload_copy_throughput_bytes_per_second",
            "Copy throughput over the last sampling period.",
            labels=["direction"],
        )
        rate.add_metric(["store"], self.rates.get("store", 0.0))
        rate.add_metric(["load"], self.rates.get("load", 0.0))
        yield rate
        yield CounterMetricFamily(
            "kvoffload_copy_planned_pages",
            "Engine pages in submitted copy jobs (one per block and cache).",
            value=copies["planned_pages_total"],
        )
        yield CounterMetricFamily(
            "kvoffload_copy_planned_runs",
            "Copy runs those pages merged into: pages / runs is the mean run length.",
            value=copies["planned_runs_total"],
        )
        yield CounterMetricFamily(
            "kvoffload_copy_jobs_failed",
            "Copy jobs that failed.",
            value=copies["failed_jobs_total"],
        )
        region = s["region"]
        yield GaugeMetricFamily(
            "kvoffload_region_bytes", "Size of the region.", value=region["region_bytes"]
        )
        yield GaugeMetricFamily(
            "kvoffload_region_used_bytes",
            "Bytes of stored or writing blocks.",
            value=s["blocks"]["used_bytes"],
        )
        yield GaugeMetricFamily(
            "kvoffload_region_occupancy_ratio",
            "Fraction of extents owned by a namespace.",
            value=s["blocks"]["occupancy_ratio"],
        )
        yield GaugeMetricFamily(
            "kvoffload_clients", "Connected clients.", value=s["clients"]["connected"]
        )
        yield from _population_metrics(s)
        yield from _tier_metrics(s["tiers"])
        errors = CounterMetricFamily("kvoffload_errors", "Error replies by code.", labels=["code"])
        for code in ErrorCode:  # every code from the first scrape, most at 0
            errors.add_metric([code.name], s["errors"].get(code.name, 0))
        yield errors


_TIER_COUNTERS = (
    ("stores_total", "Blocks the tier wrote (cascades).", "tier_stored_blocks"),
    ("store_failures_total", "Blocks the tier failed to write.", "tier_store_failures"),
    (
        "promoted_blocks_total",
        "Blocks promoted from the tier into the region.",
        "tier_promoted_blocks",
    ),
    (
        "promotion_failures_total",
        "Promotions from the tier that failed.",
        "tier_promotion_failures",
    ),
    ("found_keys_total", "Region misses the tier held.", "tier_found_keys"),
    ("evicted_blocks_total", "Blocks the tier evicted for its capacity.", "tier_evicted_blocks"),
    (
        "cascade_dropped_total",
        "Cascades skipped (backlog full, or evicted first).",
        "tier_cascade_dropped",
    ),
    (
        "auth_failures_total",
        "Blocks refused by their seal (another secret, a bad MAC, an older format).",
        "tier_auth_failures",
    ),
)
_TIER_GAUGES = (
    ("blocks", "Blocks the tier holds.", "tier_blocks"),
    ("used_bytes", "Bytes the tier holds.", "tier_used_bytes"),
    ("capacity_bytes", "The tier's capacity (0: bounded by the store).", "tier_capacity_bytes"),
    (
        "cascade_backlog_blocks",
        "Blocks waiting to cascade to the tier.",
        "tier_cascade_backlog_blocks",
    ),
    ("healthy", "1 while the tier is reachable.", "tier_healthy"),
)


def _tier_metrics(tiers: dict[str, Any]) -> Iterator[Metric]:
    """One series per secondary tier, labelled with its config name and kind."""
    per_tier = {k: v for k, v in tiers.items() if isinstance(v, dict)}
    for families, kind in (
        (_TIER_COUNTERS, CounterMetricFamily),
        (_TIER_GAUGES, GaugeMetricFamily),
    ):
        for field, doc, name in families:
            fam = kind(f"kvoffload_{name}", doc, labels=["tier", "kind"])
            for tier, st in per_tier.items():
                fam.add_metric([tier, st["kind"]], float(st[field]))
            yield fam


_NODE_GAUGES = (
    ("bytes", "Bytes of the region placed on the NUMA node.", "region_node_bytes"),
    ("populated_bytes", "Bytes of the node's part populated.", "region_node_populated_bytes"),
    ("ready_bytes", "Bytes of the node's part ready to hand out.", "region_node_ready_bytes"),
    ("pinned_bytes", "Bytes of the node's part page-locked.", "region_node_pinned_bytes"),
    (
        "populate_rate_bytes_per_s",
        "The node's populate rate so far (final once populated).",
        "region_node_populate_rate_bytes_per_second",
    ),
)


def _population_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    """Population, readiness and pinning: per node, and the pin chunks' timings."""
    region = s["region"]
    for field, doc in (
        ("populated_bytes", "Bytes of the region populated (faulted in)."),
        ("ready_bytes", "Bytes of the region ready: populated, and pinned while pinning."),
    ):
        yield GaugeMetricFamily(f"kvoffload_region_{field}", doc, value=region[field])
    yield GaugeMetricFamily(
        "kvoffload_region_populate_rate_bytes_per_second",
        "Populate rate over all threads so far (final once populated).",
        value=region["populate_rate_bytes_per_s"],
    )
    for field, doc, name in _NODE_GAUGES:
        fam = GaugeMetricFamily(f"kvoffload_{name}", doc, labels=["node"])
        for node, st in s["numa_nodes"].items():
            fam.add_metric([node], float(st[field]))
        yield fam
    gpu = s["gpu"]
    if not gpu.get("enabled"):
        return
    yield GaugeMetricFamily(
        "kvoffload_region_pinned_bytes", "Bytes of the region page-locked.", gpu["pinned_bytes"]
    )
    for field, doc, name in (
        ("pin_chunk_seconds_last", "The last chunk's registration.", "pin_chunk_last_seconds"),
        ("pin_chunk_seconds_max", "The slowest chunk's registration.", "pin_chunk_max_seconds"),
        ("pin_first_chunk_s", "From start to the first chunk pinned.", "pin_first_chunk_seconds"),
    ):
        yield GaugeMetricFamily(f"kvoffload_region_{name}", doc, value=gpu[field])
    for field, doc, name in (
        ("pin_wait_seconds_total", "Waiting for chunks to be populated.", "pin_wait_seconds"),
        ("pin_register_seconds_total", "In registrations.", "pin_register_seconds"),
    ):
        yield CounterMetricFamily(f"kvoffload_region_{name}", doc, value=gpu[field])


HEALTH_STALE_S = 5.0  # no publication for this long: the loop is stuck


def readiness(stats: dict[str, Any]) -> list[str]:
    """What keeps the daemon from being ready (empty: ready), from one stats snapshot."""
    pending = []
    if stats["server"]["shutting_down"]:
        pending.append("shutting down")
    region = stats["region"]
    if region["prefaulted_bytes"] < region["data_bytes"]:
        done = 100 * region["prefaulted_bytes"] // max(1, region["data_bytes"])
        pending.append(f"pre-faulting the region ({done}%)")
    gpu = stats["gpu"]
    if (
        gpu.get("enabled")
        and gpu["pinned_bytes"] < gpu["pin_target_bytes"]
        and not gpu["pin_error"]
    ):
        pending.append(f"pinning the region ({gpu['pinned_bytes']} of {gpu['pin_target_bytes']})")
    return pending


class MetricsEndpoint:
    def __init__(self, address: str, port: int, namespace_labels: bool = False) -> None:
        self.collector = StatsCollector(namespace_labels)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._last: dict[str, Any] | None = None
        self._published_s = 0.0
        self._rendered = (-1.0, b"")  # (publication, its /metrics body)
        self.server = HttpServer(
            address,
            port,
            {"/metrics": self._metrics, "/healthz": self._healthz, "/readyz": self._readyz},
        )
        log.info("metrics on http://%s:%d/metrics", address, self.server.port)

    def publish(self, stats: dict[str, Any], period_s: float) -> None:
        rates: dict[str, float] = {}
        if self._last is not None and period_s > 0:
            for key, name in (("stored_bytes_total", "store"), ("loaded_bytes_total", "load")):
                rates[name] = (stats["copies"][key] - self._last["copies"][key]) / period_s
        self._last = stats
        self.collector.publish(stats, rates)
        self._published_s = time.monotonic()

    def _metrics(self) -> tuple[int, str, bytes]:
        published_s = self._published_s
        if self._rendered[0] != published_s:  # once per publication, however many ask
            self._rendered = (published_s, generate_latest(self.registry))
        return 200, CONTENT_TYPE_LATEST, self._rendered[1]

    def _healthz(self) -> tuple[int, str, bytes]:
        age_s = time.monotonic() - self._published_s
        if self._last is None or age_s > HEALTH_STALE_S:
            return _json(
                503, {"alive": False, "reason": f"the loop has not turned for {age_s:.1f} s"}
            )
        return _json(200, {"alive": True, "loop_turned_s_ago": round(age_s, 3)})

    def _readyz(self) -> tuple[int, str, bytes]:
        if self._last is None:
            return _json(503, {"ready": False, "pending": ["starting"]})
        pending = readiness(self._last)
        gpu = self._last["gpu"]
        body = {
            "ready": not pending,
            "pending": pending,
            "gpu": gpu.get("pin_error") or gpu.get("reason", ""),
        }
        return _json(200 if not pending else 503, body)

    def close(self) -> None:
        self.server.close()


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", (json.dumps(body) + "\n").encode()
