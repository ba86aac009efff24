"""The index's Block in C (_block.c): the attributes of policies.PyBlock."""

from typing import SupportsIndex

class Block:
    slot: int
    ref: int
    def __init__(self, slot: SupportsIndex, /) -> None: ...
    @property
    def is_ready(self) -> bool: ...
