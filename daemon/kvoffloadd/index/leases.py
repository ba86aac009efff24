"""Slot leases: empty slots handed to an engine ahead of its stores.

An engine's scheduler must not wait for the daemon in a scheduler step, so it plans
stores from slots it already holds: the daemon grants each (connection, namespace) a
small pool of free slots, identified by an unguessable lease token, and refills it in
the background (evicting to make room outside any request). The engine claims slots
for keys in its per-step batch; its workers copy into them naming the token.

Rules:
- A token belongs to one connection and one namespace; only copies that name it may
  write its slots (DESIGN.md invariant 9). Tokens are random 63-bit numbers, never
  reused, so a token of a dead connection or an earlier daemon matches nothing.
- A slot is in exactly one of: leased (granted, not claimed), claimed (``writing``,
  or a ``shadow``: the key was stored by someone else meanwhile, so this copy is
  dropped at commit and one copy stays), or neither. Shadows are kept by slot: a
  token that claims one key into many slots holds each of them, counted
  (``shadow_count``), until it commits the key or goes away.
- A connection that goes away frees its unclaimed slots at once; its claimed ones
  fail like any store of a dead client.
- Unclaimed slots are counted per token, per uid (``grant`` names it) and in total,
  so the channel can hold every grant to the namespace's lease budget however many
  connections ask (engines.py).
- A token's last grant or claim is remembered: one that holds unclaimed slots and has
  not claimed for a while (``idle``) gets them taken back.
- ``token_of`` is changed only through ``assign``/``release``/``forget``: its numpy
  mirror ``owner`` (0: no token) lets a store's submit check all its slots at once.
- Pure bookkeeping, loop thread only; the index allocates and frees the slots.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvoffloadd.region.slots import FEW_SLOTS


def new_token() -> int:
    """A fresh lease token (never 0, which means "no lease")."""
    return secrets.randbits(63) | 1


class LeaseBook:
    def __init__(self) -> None:
        self.token_of: dict[int, int] = {}  # slot -> token, leased or claimed under a lease
        self._unclaimed: dict[int, set[int]] = {}  # token -> slots granted, not claimed
        self._uid_of: dict[int, int] = {}  # token -> the uid it was granted to
        self._tokens_of_uid: dict[int, int] = {}  # uid -> its tokens holding leases
        self._unclaimed_by_uid: dict[int, int] = {}
        self._num_unclaimed = 0
        # token -> key -> slots of duplicates of a key someone else stored meanwhile
        self._shadows: dict[int, dict[bytes, list[int]]] = {}
        self._shadow_counts: dict[int, int] = {}  # token -> its duplicates
        self._num_shadows = 0
        self.owner: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)  # token_of, by slot
        self._active_s: dict[int, float] = {}  # token -> its last grant or claim

    def assign(self, slot: int, token: int) -> None:
        """``slot`` is written under ``token`` (claimed, or prepared by its engine)."""
        self.token_of[slot] = token
        if slot >= self.owner.size:
            grown = np.zeros(max(2 * self.owner.size, slot + 1, 1024), dtype=np.int64)
            grown[: self.owner.size] = self.owner
            self.owner = grown
        self.owner[slot] = token

    def assign_many(self, slots: Sequence[int], token: int) -> None:
        """``assign`` for each of ``slots`` (a store's batch: one mirror write)."""
        if not slots:
            return
        self.token_of.update(dict.fromkeys(slots, token))
        top = max(slots)
        if top >= self.owner.size:
            grown = np.zeros(max(2 * self.owner.size, top + 1, 1024), dtype=np.int64)
            grown[: self.owner.size] = self.owner
            self.owner = grown
        owner = self.owner
        for slot in slots:  # scalar stores: cheaper than one fancy index for a step's few
            owner[slot] = token

    def grant(self, token: int, slots: list[int], uid: int = -1, now_s: float = 0.0) -> None:
        self._unclaimed.setdefault(token, set()).update(slots)
        self._active_s[token] = now_s
        if token not in self._uid_of:
            self._uid_of[token] = uid
            self._tokens_of_uid[uid] = self._tokens_of_uid.get(uid, 0) + 1
        self._count(token, len(slots))
        self.assign_many(slots, token)

    def _count(self, token: int, n: int) -> None:
        uid = self._uid_of.get(token, -1)
        self._unclaimed_by_uid[uid] = self._unclaimed_by_uid.get(uid, 0) + n
        if not self._unclaimed_by_uid[uid]:
            del self._unclaimed_by_uid[uid]
        self._num_unclaimed += n

    def holders(self, token: int = 0) -> int:
        """Tokens that hold (or held) leases and are still alive, ``token`` included."""
        return len(self._unclaimed) + (token not in self._unclaimed)

    def holder_uids(self, uid: int) -> int:
        """Uids whose tokens hold leases, ``uid`` included."""
        return len(self._tokens_of_uid) + (uid not in self._tokens_of_uid)

    def unclaimed(self, token: int) -> int:
        return len(self._unclaimed.get(token, ()))

    def unclaimed_by_uid(self, uid: int) -> int:
        return self._unclaimed_by_uid.get(uid, 0)

    def total_unclaimed(self) -> int:
        return self._num_unclaimed

    def is_unclaimed(self, token: int, slot: int) -> bool:
        return slot in self._unclaimed.get(token, ())

    def claim(self, token: int, slot: int, now_s: float = 0.0) -> bool:
        """Take a granted slot out of the pool; False when it was not granted to token."""
        return self.claim_many(token, (slot,), now_s)[0]

    def claim_many(self, token: int, slots: Sequence[int], now_s: float = 0.0) -> list[bool]:
        """``claim`` of each of ``slots`` in order: whether each was granted to ``token``."""
        pool = self._unclaimed.get(token)
        if pool is None:
            return [False] * len(slots)
        took, discard = [], pool.discard
        for slot in slots:
            if slot in pool:
                discard(slot)
                took.append(True)
            else:
                took.append(False)
        n = took.count(True)
        if n:
            self._count(token, -n)
            self._active_s[token] = now_s
        return took

    def idle(self, now_s: float, timeout_s: float) -> list[int]:
        """Tokens holding unclaimed slots that have neither claimed nor been granted one
        for ``timeout_s``."""
        cutoff = now_s - timeout_s
        return [t for t, pool in self._unclaimed.items() if pool and self._active_s[t] < cutoff]

    def may_write(self, token: int, slot: int) -> bool:
        """Whether a copy naming ``token`` may write ``slot``."""
        return token != 0 and self.token_of.get(slot) == token

    def all_writable(self, token: int, slots: npt.NDArray[np.int64]) -> bool:
        """Whether a copy naming ``token`` may write every one of ``slots`` (each
        ``0 <= slot``, checked by the caller)."""
        if token == 0 or slots.size == 0:
            return token != 0
        if slots.size <= FEW_SLOTS:  # a step's few: as a list
            get = self.token_of.get
            return all(get(slot) == token for slot in slots.tolist())
        owner = self.owner
        if int(slots.max()) >= owner.size:
            return False
        return bool((owner[slots] == token).all())

    def release(self, token: int) -> list[int]:
        """The token's connection is gone: its unclaimed slots, to be freed."""
        slots = sorted(self._unclaimed.pop(token, set()))
        self._count(token, -len(slots))
        self._active_s.pop(token, None)
        uid = self._uid_of.pop(token, None)
        if uid is not None:
            left = self._tokens_of_uid[uid] - 1
            if left:
                self._tokens_of_uid[uid] = left
            else:
                del self._tokens_of_uid[uid]
        for s in slots:
            self.token_of.pop(s, None)
        self.owner[slots] = 0
        return slots

    def add_shadow(self, token: int, key: bytes, slot: int) -> None:
        """``token`` claimed ``slot`` for ``key``, which is stored already."""
        self._shadows.setdefault(token, {}).setdefault(key, []).append(slot)
        self._shadow_counts[token] = self._shadow_counts.get(token, 0) + 1
        self._num_shadows += 1

    def pop_shadows(self, token: int, key: bytes) -> list[int]:
        """The slots of ``token``'s duplicates of ``key`` (taken out: to be freed)."""
        mine = self._shadows.get(token)
        slots = mine.pop(key, []) if mine else []
        if slots:
            self._num_shadows -= len(slots)
            self._shadow_counts[token] -= len(slots)
            if not mine:
                del self._shadows[token], self._shadow_counts[token]
        return slots

    def release_shadows(self, token: int) -> list[int]:
        """Every duplicate's slot of ``token`` (its connection is gone: to be freed)."""
        slots = [s for group in self._shadows.pop(token, {}).values() for s in group]
        self._num_shadows -= len(slots)
        self._shadow_counts.pop(token, None)
        return slots

    def shadow_count(self, token: int | None = None) -> int:
        """Duplicates held by ``token``, or by every token."""
        return self._num_shadows if token is None else self._shadow_counts.get(token, 0)

    def forget(self, slot: int) -> None:
        """The slot was freed."""
        self.forget_many((slot,))

    def forget_many(self, slots: Sequence[int]) -> None:
        """These slots were freed (one mirror write for all of them)."""
        pop, unclaimed, owner = self.token_of.pop, self._unclaimed, self.owner
        for slot in slots:
            token = pop(slot, None)
            if token is not None:
                owner[slot] = 0
                pool = unclaimed.get(token)
                if pool is not None and slot in pool:
                    pool.discard(slot)
                    self._count(token, -1)
