"""Optional Prometheus endpoint (``metrics_port``), fed from the loop's stats snapshot.

Rules:
- The HTTP server runs in prometheus-client's own thread and never touches daemon
  metadata: the loop thread publishes an immutable ``render_stats`` snapshot each cron
  tick and the collector only reads the latest one (a reference swap).
- Names follow Prometheus conventions: ``kvoffload_`` prefix, base units (bytes,
  seconds), ``_total`` for counters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

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
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None
        self.rates: dict[str, float] = {}

    def publish(self, stats: dict[str, Any], rates: dict[str, float]) -> None:
        self.snapshot, self.rates = stats, rates

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        namespaces: dict[str, dict[str, Any]] = s["namespaces"]
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
        yield from _tier_metrics(s["tiers"])
        errors = CounterMetricFamily("kvoffload_errors", "Error replies by code.", labels=["code"])
        for code, n in s["errors"].items():
            errors.add_metric([code], n)
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


class MetricsEndpoint:
    def __init__(self, address: str, port: int) -> None:
        self.collector = StatsCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._last: dict[str, Any] | None = None
        self.server, self.thread = start_http_server(port, address, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", address, port)

    def publish(self, stats: dict[str, Any], period_s: float) -> None:
        rates: dict[str, float] = {}
        if self._last is not None and period_s > 0:
            for key, name in (("stored_bytes_total", "store"), ("loaded_bytes_total", "load")):
                rates[name] = (stats["copies"][key] - self._last["copies"][key]) / period_s
        self._last = stats
        self.collector.publish(stats, rates)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
