"""The region's slot records in C (_slotrecords.c): a batch of records per call."""

import mmap
from collections.abc import Sequence

RECORD_BYTES: int
KEY_BYTES_MAX: int
OFF_KEY_LEN: int
OFF_NS: int
OFF_SEQ: int
OFF_KEY: int
OFF_LEASE: int
OFF_CRC: int

def writing(
    table: mmap.mmap | bytearray,
    table_offset: int,
    spe: int,
    extents: list[int | None],
    spe_max: int,
    slots: Sequence[int],
    keys: Sequence[bytes],
    ns: int,
    lease: int,
    /,
) -> None: ...
def leased(
    table: mmap.mmap | bytearray,
    table_offset: int,
    spe: int,
    extents: list[int | None],
    spe_max: int,
    slots: Sequence[int],
    ns: int,
    lease: int,
    /,
) -> None: ...
def freed(
    table: mmap.mmap | bytearray,
    table_offset: int,
    spe: int,
    extents: list[int | None],
    spe_max: int,
    slots: Sequence[int],
    /,
) -> None: ...
def ready(
    table: mmap.mmap | bytearray,
    table_offset: int,
    spe: int,
    extents: list[int | None],
    spe_max: int,
    slots: Sequence[int],
    keys: Sequence[bytes],
    ns: int,
    first_seq: int,
    /,
) -> None: ...
def crc32(data: bytes, /) -> int: ...
