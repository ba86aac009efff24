"""Secondary tiers below the region: the interface (base.py), disk, Redis, Mooncake."""

from __future__ import annotations

from typing import Any

from ..config import TierConfig, parse_size
from .base import SecondaryTier, TierError, TierJob, TierNamespace, TierResult, WakeFd

__all__ = [
    "SecondaryTier",
    "TierError",
    "TierJob",
    "TierNamespace",
    "TierResult",
    "WakeFd",
    "build_tier",
]


def build_tier(cfg: TierConfig, wake: Any) -> SecondaryTier:
    """The tier a ``[[tiers]]`` entry describes; ``TierError`` when it cannot start."""
    if cfg.type == "disk":
        from .disk import DiskTier

        return DiskTier(
            cfg.name,
            cfg.path,
            cfg.capacity_bytes,
            wake,
            threads=cfg.threads,
            fsync=cfg.fsync,
            verify=cfg.verify,
        )
    if cfg.type == "mooncake":
        from .mooncake_tier import MooncakeSettings, MooncakeTier

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
            verify=cfg.verify,
            threads=cfg.threads,
            lease_ttl_s=cfg.lease_ttl_s,
        )
        return MooncakeTier(cfg.name, settings, cfg.capacity_bytes, wake)
    from .redis_tier import RedisTier

    return RedisTier(
        cfg.name,
        cfg.url,
        cfg.capacity_bytes,
        wake,
        prefix=cfg.prefix,
        ttl_s=cfg.ttl_s,
        connections=cfg.threads,
        timeout_s=cfg.timeout_s,
        refresh_s=cfg.refresh_s,
        full_sync_s=cfg.full_sync_s,
        verify=cfg.verify,
    )
