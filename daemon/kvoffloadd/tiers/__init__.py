"""Secondary tiers below the region: the interface (``base``), disk, Redis, Mooncake,
the MAC that seals every block they hold (``blockauth``), and the cascade and
promotion between the region and them (``tiering``).

Rules:
- Nothing a tier holds is trusted: every block carries a keyed MAC over its namespace,
  key, length and bytes, and fails closed (a miss) when it does not verify.
- Tier I/O runs on each tier's own threads; promoted blocks are copied and verified on
  each tier's promotion threads (``spread``); ``tiering`` runs on the loop thread and
  pins region blocks only for bounded, timed jobs.
- A tier fault stays inside its key or its tier; the daemon serves on without it.
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffloadd.config import TierConfig, parse_size
from kvoffloadd.tiers.base import (
    SecondaryTier,
    TierError,
    TierJob,
    TierNamespace,
    TierResult,
    WakeFd,
)
from kvoffloadd.tiers.blockauth import BlockMac, read_secret

log = logging.getLogger(__name__)

__all__ = [
    "BlockMac",
    "SecondaryTier",
    "TierError",
    "TierJob",
    "TierNamespace",
    "TierResult",
    "WakeFd",
    "build_tier",
    "read_secret",
]


def build_tier(cfg: TierConfig, wake: Any, mac: BlockMac, tier_threads: int = 1) -> SecondaryTier:
    """The tier a ``[[tiers]]`` entry describes, sealing its blocks with ``mac`` and
    promoting them on ``tier_threads`` threads; ``TierError`` when it cannot start."""
    if not cfg.verify:
        log.warning(
            "tier %s: verify = false no longer turns checks off: every block's MAC is "
            "checked (remove the key)",
            cfg.name,
        )
    if cfg.type == "disk":
        from kvoffloadd.tiers.disk import DiskTier

        return DiskTier(
            cfg.name,
            cfg.path,
            cfg.capacity_bytes,
            wake,
            mac=mac,
            threads=cfg.threads,
            tier_threads=tier_threads,
            fsync=cfg.fsync,
        )
    if cfg.type == "mooncake":
        from kvoffloadd.tiers.mooncake_tier import MooncakeSettings, MooncakeTier

        where = f"tiers.{cfg.name}"
        settings = MooncakeSettings(
            master=cfg.master,
            metadata_server=cfg.metadata_server,
            local_hostname=cfg.local_hostname,
            protocol=cfg.protocol,
            device=cfg.device,
            segment_bytes=cfg.segment_bytes,
            local_buffer_bytes=parse_size(cfg.local_buffer_size, f"{where}.local_buffer_size"),
            prefix=cfg.prefix,
            admin_url=cfg.admin_url,
            timeout_s=cfg.timeout_s,
            refresh_s=cfg.refresh_s,
            full_sync_s=cfg.full_sync_s,
            threads=cfg.threads,
            tier_threads=tier_threads,
            lease_ttl_s=cfg.lease_ttl_s,
            max_view_blocks=cfg.max_view_blocks,
        )
        return MooncakeTier(cfg.name, settings, cfg.capacity_bytes, wake, mac=mac)
    from kvoffloadd.tiers.redis_tier import RedisTier

    return RedisTier(
        cfg.name,
        cfg.url,
        cfg.capacity_bytes,
        wake,
        mac=mac,
        prefix=cfg.prefix,
        ttl_s=cfg.ttl_s,
        connections=cfg.threads,
        timeout_s=cfg.timeout_s,
        refresh_s=cfg.refresh_s,
        full_sync_s=cfg.full_sync_s,
        max_view_blocks=cfg.max_view_blocks,
        tier_threads=tier_threads,
    )
