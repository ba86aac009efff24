"""The C copy loop (_copyrun.c): run and group copies, the GIL released."""

import array

import numpy as np
import numpy.typing as npt

Buffer = npt.NDArray[np.int64] | array.array[int]

STREAMS: int  # 1 where large runs are written with non-temporal stores (x86-64)

def copy_runs(dst: Buffer, src: Buffer, nbytes: Buffer, stream_min_bytes: int, /) -> None: ...
def copy_groups(
    dst: Buffer,
    src: Buffer,
    nbytes: Buffer,
    rows: Buffer,
    dst_step: Buffer,
    src_step: Buffer,
    stream_min_bytes: int,
    /,
) -> None: ...
def copy_runs_guarded(
    dst: Buffer, src: Buffer, nbytes: Buffer, stream_min_bytes: int, /
) -> bool: ...
