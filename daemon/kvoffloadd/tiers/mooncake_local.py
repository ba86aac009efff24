"""This daemon's own Mooncake segment: written once at start, and promotions from it
copied by the tier's threads instead of Mooncake's.

Rules:
- ``warm_segment`` writes the segment once, as the region is prefaulted: Mooncake maps it
  lazily, and the first write of each page cost cascades into a fresh segment 40x (0.3
  against 12 GB/s here). Objects of zeros placed in this node's own segment fill most of
  it (below Mooncake's eviction watermark), then go; where they lay gives the segment's
  span.
- Mooncake's client copies a replica held in its own segment with one memcpy thread (its
  local path), and the tier then reads every block again for its MAC. For such
  replicas the tier's promotion threads copy instead (``tier_threads``, the blocks of
  a job spread over them by ``run``), each piece hashed just after its copy while its
  bytes are still in the cache (``copy``, blockauth.BlockMac.copy_and_hash): the bytes
  cross memory once, on as many threads as the tier has.
- Where the replica lies comes from ``batch_get_replica_desc``: the master answers with
  each object's replicas and grants each object a read lease (the master's
  ``-default_kv_lease_ttl``, ``lease_ttl_s`` here). Until it runs out Mooncake neither
  evicts nor removes the object, so its bytes stay where the answer says. Copies that end
  later than half the lease after the first question was sent are not trusted: their
  keys are read again through Mooncake, which checks its own lease.
- A load asks about its first ``FIRST_ASK`` names alone, then about the rest: each
  block's copy is released to the threads as soon as the answer about it is in, so the
  copies start while the master is asked about the rest. A question that fails comes
  back only once every copy already released has finished (their slots are then free).
- Only a complete memory replica in the segment of the client that asked (the endpoint
  ``get_hostname()`` names), of exactly the object's size, lying wholly inside that
  segment's span, is copied here; every other key (absent from the answer, elsewhere,
  another size, an address outside the span) is read through Mooncake. The span is
  learnt when the segment is first written (``segment_span``) and cut to the readable
  mappings that hold it, so no answer can make the daemon read memory that is not mapped.
  The addresses are those Mooncake's own local copy would read: the master is trusted
  no further than Mooncake's client trusts it.
- Every block copied here is checked against the MAC in its seal, so even a lease
  shorter than configured cannot pass torn bytes.
- Job threads only; nothing here touches the tier's view.
"""

from __future__ import annotations

import ctypes
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

T = TypeVar("T")
WARM_CHUNK_BYTES = 4 << 20  # objects that write the lent segment once at start
WARM_FRACTION = 0.85  # of the segment: below Mooncake's eviction watermark (0.9)
FIRST_ASK = 4  # names of a load asked about first, so their copies start sooner


@dataclass
class OwnSegmentRead:
    """What ``read_own_segment`` did with one piece of a load (indexes into the piece)."""

    tags: dict[int, bytes] = field(default_factory=dict)  # copied here: the MAC of the copy
    rest: list[int] = field(default_factory=list)  # to read through Mooncake
    answer: Any = None  # the master's replica descriptors, name -> replicas (if asked)


Span = tuple[int, int]  # [first, end) addresses of this daemon's own segment


def own_addresses(replicas: Any, endpoint: str) -> list[tuple[int, int]]:
    """(address, bytes) of the complete memory replicas among ``replicas`` that lie in
    ``endpoint``'s segment."""
    out = []
    for r in replicas or ():
        if not r.is_memory_replica() or getattr(r.status, "name", "") != "COMPLETE":
            continue
        d = r.get_memory_descriptor().buffer_descriptor
        if d.transport_endpoint == endpoint:
            out.append((int(d.buffer_address), int(d.size)))
    return out


def segment_span(
    first_address: int, segment_bytes: int, maps_path: str = "/proc/self/maps"
) -> Span | None:
    """``segment_bytes`` from the lowest address an object of the segment was given, cut
    to the readable mappings of this process that run on unbroken from that address
    (None: it is not mapped)."""
    end = first_address + segment_bytes
    reach = 0  # where the readable memory from first_address ends, so far
    with open(maps_path, encoding="ascii") as f:
        for line in f:
            where, perms = line.split(maxsplit=2)[:2]
            lo_text, _, hi_text = where.partition("-")
            lo, hi = int(lo_text, 16), int(hi_text, 16)
            if not perms.startswith("r") or hi <= first_address:
                continue
            holds_first = not reach and lo <= first_address
            runs_on = reach and lo == reach
            if not (holds_first or runs_on):
                break  # unmapped (or unreadable) memory comes first
            reach = hi
            if reach >= end:
                break
    return (first_address, min(reach, end)) if reach else None


def object_sizes(replicas: Any) -> set[int]:
    """Sizes of the complete memory replicas the master describes (from another node:
    data, used only to skip an object that cannot be a block, never to bound a read)."""
    out = set()
    for r in replicas or ():
        if r.is_memory_replica() and getattr(r.status, "name", "") == "COMPLETE":
            out.add(int(r.get_memory_descriptor().buffer_descriptor.size))
    return out


def _own_address(replicas: Any, endpoint: str, object_bytes: int, span: Span) -> int | None:
    for address, size in own_addresses(replicas, endpoint):
        if size == object_bytes and span[0] <= address and address + size <= span[1]:
            return address
    return None


class Released(Protocol[T]):
    """Blocks whose work runs once released (``spread.Started``, or ``InTurn``)."""

    def release(self, ready: int) -> None: ...

    def wait(self) -> list[T | None]: ...


class InTurn(Generic[T]):
    """``Released`` on the caller's thread: each block runs as it is released."""

    def __init__(self, n: int, work: Callable[[int], T]) -> None:
        self._work = work
        self._results: list[T | None] = []
        self._n = n

    def release(self, ready: int) -> None:
        while len(self._results) < min(ready, self._n):
            self._results.append(self._work(len(self._results)))

    def wait(self) -> list[T | None]:
        return self._results


def read_own_segment(
    client: Any,
    names: Sequence[str],
    block_bytes: int,
    copy: Callable[[int, int], bytes],
    headers: Sequence[int],
    header_bytes: int,
    span: Span,
    lease_ttl_s: float,
    clock: Callable[[], float] = time.monotonic,
    start: Callable[[int, Callable[[int], bytes | None]], Released[bytes]] = InTurn,
) -> OwnSegmentRead:
    """Copy the objects among ``names`` that lie in ``client``'s own segment: block ``j``
    by ``copy(j, source address)``, which answers its MAC, its header to ``headers[j]``.
    The copies run through ``start(count, work)`` (the tier's promotion threads), each
    released as soon as the master has said where its object lies: the first
    ``FIRST_ASK`` names are asked alone, so copies start while the rest are asked. A
    copy that raised leaves its block to Mooncake; none runs on once this returns."""
    out = OwnSegmentRead()
    started_s = clock()
    endpoint = client.get_hostname()
    n = block_bytes
    sources: list[int | None] = [None] * len(names)  # set before each is released

    def copy_one(j: int) -> bytes | None:
        src = sources[j]
        if src is None:
            return None  # not in this segment: Mooncake reads it
        ctypes.memmove(headers[j], src + n, header_bytes)
        return copy(j, src)

    answer: dict[str, Any] = {}
    copies = start(len(names), copy_one)
    try:
        first = min(FIRST_ASK, len(names))
        for a, b in ((0, first), (first, len(names))):
            if a == b:
                continue
            part = client.batch_get_replica_desc(list(names[a:b]))
            answer.update(part)
            for j in range(a, b):
                sources[j] = _own_address(part.get(names[j]), endpoint, n + header_bytes, span)
            copies.release(b)
    finally:
        copies.release(len(names))  # those never asked about copy nothing
        tags = copies.wait()
    for j, tag in enumerate(tags):
        if tag is None:
            out.rest.append(j)
        else:
            out.tags[j] = tag
    out.answer = answer
    if out.tags and clock() - started_s > lease_ttl_s / 2:  # the lease may have run out
        return OwnSegmentRead(rest=list(range(len(names))), answer=answer)
    return out


def warm_segment(
    client: Any, prefix: str, segment_bytes: int, zeros: npt.NDArray[np.uint8]
) -> Span | None:
    """Write ``client``'s segment once with objects of ``zeros`` (registered, of
    ``WARM_CHUNK_BYTES``); its span, None where it has none or Mooncake cannot place
    objects in it."""
    module = importlib.import_module(type(client).__module__)
    config_class = getattr(module, "ReplicateConfig", None)
    if not segment_bytes or config_class is None:
        return None
    config = config_class()
    endpoint = config.preferred_segment = client.get_hostname()
    chunk, ptr = zeros.nbytes, int(zeros.ctypes.data)
    names = [
        f"{prefix}/warm/{endpoint}/{i}" for i in range(int(segment_bytes * WARM_FRACTION) // chunk)
    ]
    for a in range(0, len(names), 64):
        part = names[a : a + 64]
        client.batch_put_from(part, [ptr] * len(part), [chunk] * len(part), config)
    answer = client.batch_get_replica_desc(names) if names else {}
    placed = [a for n in names for a, _ in own_addresses(answer.get(n), endpoint)]
    client.batch_remove(names, True)
    return segment_span(min(placed), segment_bytes) if placed else None
