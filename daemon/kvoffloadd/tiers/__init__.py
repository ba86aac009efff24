"""Secondary tiers below the region: the interface (base.py), disk and Redis."""

from __future__ import annotations

from typing import Any

from ..config import TierConfig
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
