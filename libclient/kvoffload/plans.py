"""Value types of the offloading-manager contract, shared by the client and the daemon."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StorePlan:
    """Keys to store (the ones not stored yet), their leased slots, and what was evicted.
    ``lease``: the token an engine's workers, on connections of their own, name to copy
    into these slots (``Worker.submit_store(..., lease=plan.lease)``)."""

    keys_to_store: list[bytes]
    slots: list[int]
    evicted_keys: list[bytes]
    lease: int = field(default=0, compare=False)


@dataclass(frozen=True)
class LoadPlan:
    """Slots of the pinned blocks, in key order."""

    slots: list[int]


@dataclass(frozen=True)
class OffloadEvent:
    """Keys stored (``removed=False``) or evicted (``removed=True``) together; a store
    event also says which slot holds each key (``slots``, co-indexed)."""

    keys: list[bytes]
    removed: bool
    slots: list[int] | None = field(default=None, compare=False)  # placement, not identity
