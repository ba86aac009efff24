"""vLLM's OffloadingWorker (one per engine rank), backed by kvoffloadd copies.

Rules:
- Built from vLLM's ``CanonicalKVCaches``: each KV cache group's tensors (those its
  layers reference) are one worker in the group's namespace of the rank's pipeline
  stage (``identity``), so a slot holds exactly one group's pages. CUDA tensors go by
  IPC handle, memfd tensors by descriptor, plain CPU tensors in client-copy mode; the
  mode is picked automatically and logged. A group with no layer on this rank's stage
  registers a one-byte placeholder, so its blocks are whole on every stage.
- A vLLM job covers one or more KV cache groups (``GPULoadStoreSpec.group_sizes``);
  each non-empty group is one kvoffload job in its namespace, with this stage's slots
  (``SlotsSpec.stage_slots``). The keys of a job are grouped as its blocks are.
- A store writes every sub-block of each slot it names: where vLLM left null blocks
  at the head of a sliding window group's first chunk (``block_indices[g] %
  blocks_per_chunk`` of them), the null block (id 0) fills their places, so the slot
  is whole and loads, which skip those sub-blocks, read only bytes of this store. A
  group whose blocks cannot be placed whole (a null block inside a chunk) is not
  stored (counted in ``unplaced_stores_total``, logged once). A stage that already
  holds a key skips its chunk.
- vLLM 0.33 asserts that every submit and every result succeeded, so this worker
  never reports a failure (``kvoffload.engine.streaming``): a store that could not happen is
  reported finished and is simply not offloaded; a planned load completes byte-exact
  or stops the engine with ``LoadLostError`` naming why.
- A vLLM job finishes when all its parts did. Client copies of stores, their
  ``Wrote`` and the read of the pushes happen at a step's first call (a submit,
  before the forward pass, or the step's ``get_finished``), at most every
  ``batch_interval_s``: the daemon's turn on them overlaps the forward pass, not the
  scheduler's work after it. While loads are in flight their results are read at
  every ``get_finished``.
- The first call of a step adopts a connection the client rebuilt in the background,
  before any job names a worker or a lease.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvoffload.cache import shared_kv_cache
from kvoffload.client import Client
from kvoffload.datapath.canonical import CanonicalPart
from kvoffload.engine.streaming import StreamingWorker
from kvoffload.protocol.messages import KVLayout
from kvoffload.vllm.identity import VllmIdentity
from kvoffload.vllm.manager import SlotsSpec

log = logging.getLogger(__name__)

PLACEHOLDER_BYTES = 1  # a group with no layer on this stage: one byte per block


@dataclass
class GroupCaches:
    """One KV cache group's caches on this rank, and the namespace they go to."""

    group_id: int
    namespace: str
    layout: KVLayout
    caches: list[Any]
    canonical: list[CanonicalPart] = field(default_factory=list)
    placeholder: bool = False


@dataclass
class _Job:
    parts_left: int
    nbytes: int = 0
    seconds: float = 0.0


# (group index, engine block ids, slots, skip, keys, lease)
Part = tuple[int, list[int], list[int], int, list[bytes], int]


class KVOffloadWorker(OffloadingWorker):
    def __init__(
        self,
        client: Client,
        groups: Sequence[GroupCaches],
        rank: int,
        stage: int,
        blocks_per_chunk: int,
        copy_mode: str = "auto",
        store_timeout_s: float = 10.0,
        load_wait_s: float = 10.0,
        parts: int = 0,
        batch_interval_s: float = 0.0,
    ) -> None:
        self.client = client
        self.stage = stage
        self.f = blocks_per_chunk
        self.batch_interval_s = batch_interval_s
        self.groups = list(groups)
        self._suffixes = [g.group_id.to_bytes(4, "big") for g in self.groups]
        self.workers: list[StreamingWorker] = []
        for g in self.groups:
            ns = client.namespace(g.namespace, g.layout, subscribe=False)
            w = StreamingWorker(
                ns,
                g.caches,
                rank,
                copy_mode="auto" if g.placeholder else copy_mode,
                store_timeout_s=store_timeout_s,
                load_wait_s=load_wait_s,
                canonical=g.canonical,
                parts=max(parts, 1),
            )
            self.workers.append(w)
            log.info(
                "kvoffload: rank %d (stage %d) attached %s to namespace %s (%s copies, %s)",
                rank,
                stage,
                "a placeholder: no layer of this KV cache group is on this stage"
                if g.placeholder
                else f"{len(g.caches)} KV tensors",
                ns.name,
                "client" if w.copy_mode == "client" else "daemon",
                f"canonical pages, part {rank} of {parts}" if parts else "per-rank pages",
            )
        self.worker = self.workers[0]
        self._part_ids = itertools.count(1)
        self._part_job: dict[int, tuple[int, int]] = {}  # part id -> (vLLM job, group)
        self._jobs: dict[int, _Job] = {}
        self._done: list[TransferResult] = []
        self._io_at = 0.0
        self.clock: Callable[[], float] = time.monotonic  # what the interval is read on
        self._in_step = False  # a call of this step was made (the next result call ends it)
        self.unplaced_stores_total = 0

    @property
    def stores_dropped_total(self) -> int:
        return sum(w.stores_dropped_total for w in self.workers) + self.unplaced_stores_total

    @property
    def loads_recovered_total(self) -> int:
        return sum(w.loads_recovered_total for w in self.workers)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_store=False)

    def _submit(
        self, job_id: int, gpu: GPULoadStoreSpec, slot_spec: LoadStoreSpec, is_store: bool
    ) -> bool:
        if not isinstance(slot_spec, SlotsSpec):
            raise TypeError(f"expected kvoffload slots, got {type(slot_spec).__name__}")
        self._begin_step()
        self.client.adopt()  # workers and leases of a new connection, before any job
        slots = slot_spec.stage_slots[self.stage] if slot_spec.stage_slots else []
        leases = slot_spec.leases[self.stage] if slot_spec.leases else []
        parts = self._split(gpu, slot_spec.keys, slots, leases, is_store)
        if not parts:
            self._done.append(TransferResult(job_id, True, 0, 0.0))
            return True
        self._jobs[job_id] = _Job(len(parts))
        for g, ids, part_slots, skip, keys, lease in parts:
            part = next(self._part_ids)
            self._part_job[part] = (job_id, g)
            w = self.workers[g]
            if is_store:
                w.submit_store(part, ids, part_slots, lease=lease)
            else:
                w.submit_load(part, part_slots, ids, skip, keys=keys)
        return True

    def _split(
        self,
        gpu: GPULoadStoreSpec,
        keys: list[bytes],
        slots: list[int],
        leases: list[int],
        is_store: bool,
    ) -> list[Part]:
        """One part per non-empty group: its blocks, this stage's slots and keys."""
        ids = gpu.block_ids.tolist()
        f, out = self.f, []
        at_id = at_key = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            suffix, n = self._suffixes[g], 0
            while at_key + n < len(keys) and keys[at_key + n][-4:] == suffix:
                n += 1
            group_ids = ids[at_id : at_id + size]
            group_slots, group_keys = slots[at_key : at_key + n], keys[at_key : at_key + n]
            at_id, at_key = at_id + size, at_key + n
            if not size:
                continue
            if not is_store:
                out.append((g, group_ids, group_slots, first % f, group_keys, 0))
                continue
            whole = whole_chunks(group_ids, n, first % f, f)
            if whole is None:
                self._unplaced(g, size, n, first)
                continue
            keep = [i for i, s in enumerate(group_slots) if s >= 0]
            if keep:
                chunk_ids = [whole[i * f + j] for i in keep for j in range(f)]
                lease = leases[g] if g < len(leases) else 0
                out.append((g, chunk_ids, [group_slots[i] for i in keep], 0, [], lease))
        if at_id != len(ids) or at_key != len(keys):
            raise ValueError(
                f"spec does not add up: {len(ids)} GPU blocks and {len(keys)} keys for "
                f"groups {list(gpu.group_sizes)} starting at {list(gpu.block_indices)}"
            )
        return out

    def _unplaced(self, g: int, size: int, chunks: int, first: int) -> None:
        self.unplaced_stores_total += 1
        if self.unplaced_stores_total == 1:
            log.warning(
                "kvoffload: a store of KV cache group %d (%d blocks for %d chunks of %d, "
                "the first at block %d) has a null block inside a chunk; its chunks are not "
                "offloaded (counted in unplaced_stores_total; logged once)",
                self.groups[g].group_id,
                size,
                chunks,
                self.f,
                first,
            )

    def _begin_step(self) -> None:
        """A step's first call: when due, copy the stores submitted before, queue their
        ``Wrote``, write and read; else only adopt a new connection."""
        if self._in_step:
            return
        self._in_step = True
        now = self.clock()
        if now >= self._io_at:
            self._io_at = now + self.batch_interval_s
            for w in self.workers:
                w.report_writes()
            self.client.poll()
        else:
            self.client.adopt()

    def get_finished(self) -> list[TransferResult]:
        self._begin_step()
        self._in_step = False
        if any(w.loads_waiting for w in self.workers):
            self.client.poll()
        for w in self.workers:
            for r in w.get_finished(poll=False):
                job_id, _ = self._part_job.pop(r.job_id, (None, 0))
                if job_id is None:
                    continue
                job = self._jobs[job_id]
                job.parts_left -= 1
                job.nbytes += r.nbytes
                job.seconds = max(job.seconds, r.seconds)
                if job.parts_left == 0:
                    del self._jobs[job_id]
                    self._done.append(TransferResult(job_id, True, job.nbytes, job.seconds))
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for g, w in enumerate(self.workers):
            w.wait([p for p, (j, pg) in self._part_job.items() if pg == g and j in job_ids])

    def shutdown(self) -> None:
        for w in self.workers:
            w.close()
        self.client.close()


def whole_chunks(ids: list[int], chunks: int, skip: int, f: int) -> list[int] | None:
    """A store's engine block ids as ``chunks`` whole chunks of ``f``: the ``skip``
    null blocks vLLM left out at the head of the first chunk put back (block 0); None
    when the ids cannot be placed so (a null block inside a chunk)."""
    if len(ids) == chunks * f and not skip:
        return ids
    if len(ids) + skip == chunks * f:
        return [0] * skip + ids
    return None


def group_caches(
    kv_caches: CanonicalKVCaches,
    identity: VllmIdentity,
    namespaces: Sequence[str],
    group_ids: Sequence[int],
    world_size: int,
    canonical: bool,
    rank: int,
) -> list[GroupCaches]:
    """Each KV cache group's caches on this rank and its namespace's layout."""
    tensors = kv_caches.tensors
    blocks = int(tensors[0].tensor.shape[0]) if tensors else 1
    out = []
    for name, gid, refs in zip(namespaces, group_ids, kv_caches.group_data_refs):
        used = sorted({ref.tensor_idx for ref in refs})
        if not used:
            cache = shared_kv_cache(blocks, PLACEHOLDER_BYTES)
            layout = identity.layout([PLACEHOLDER_BYTES], world_size, gid)
            out.append(GroupCaches(gid, name, layout, [cache], placeholder=True))
            continue
        parts = canonical_parts(kv_caches, used, identity, rank) if canonical else []
        pages = (
            [p.canonical_page_bytes for p in parts]
            if canonical
            else [tensors[i].page_size_bytes for i in used]
        )
        layout = identity.layout(pages, world_size, gid)
        out.append(GroupCaches(gid, name, layout, [tensors[i].tensor for i in used], parts))
    return out


def canonical_parts(
    kv_caches: CanonicalKVCaches, used: list[int], identity: VllmIdentity, rank: int
) -> list[CanonicalPart]:
    """How each of a group's tensors maps into its canonical page (vLLM's
    ``CanonicalPageMapping`` for this rank). The scheduler chose the canonical layout
    from vLLM's static certification; a rank vLLM gives no certified mapping cannot
    write it: an error at start naming both layouts, never a silent per-rank page."""
    by_tensor: dict[int, CanonicalPageMapping] = {}
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            if ref.tensor_idx not in used:
                continue
            mapping = ref.mapping
            if mapping is None or not mapping.parallelism_agnostic:
                raise RuntimeError(
                    f"kvoffload: the engine uses the canonical layout "
                    f"{identity.canonical_format} (vLLM certified its configuration), but "
                    f"rank {rank} has no parallelism-agnostic mapping for KV tensor "
                    f"{ref.tensor_idx}, only its per-rank pages; remove canonical_layout "
                    "from kv_connector_extra_config"
                )
            if by_tensor.setdefault(ref.tensor_idx, mapping) != mapping:
                raise RuntimeError(
                    f"kvoffload: KV tensor {ref.tensor_idx} has layers with different "
                    "canonical mappings; the canonical layout needs one per tensor"
                )
    return [
        CanonicalPart(m.canonical_page_size_bytes, fragments(m.runs), m.num_writers, m.writer_index)
        for _, m in sorted(by_tensor.items())
    ]


def fragments(runs: tuple[CopyRun, ...]) -> np.ndarray:
    """(local offset, canonical offset, bytes) of every fragment of vLLM's runs."""
    rows = sorted(
        (
            r.local_offset + i * r.local_stride,
            r.canonical_offset + i * r.canonical_stride,
            r.fragment_size,
        )
        for r in runs
        for i in range(r.num_fragments)
    )
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
