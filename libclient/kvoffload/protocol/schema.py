"""The wire schema's ground: its bounds, the base of every message, and ``KVLayout``.

Rules (msgspec schema evolution, see research/aesthetics.md section 4):
- Every Struct is ``array_like``: field order is the wire format. Only append fields,
  always with a default; never reorder, retype or remove one.
- Tags are explicit short strings, so renaming a class never changes the wire.
- Every request carries ``rid``, the request id its reply echoes; ids let a client
  pipeline requests and let both sides reject replies nobody asked for.
- One-way requests (``ONE_WAY``) are sent with ``rid`` 0 and get no reply: an engine
  never waits for them. What they produce comes back as pushes (``PUSHES``, ``rid``
  0), which the daemon sends unasked: the namespace's event feed, slot leases, job
  completions, and notices of one-way requests it refused.
- Keys travel packed: all keys of one message have the same length ``key_bytes`` and
  are concatenated into one ``bytes`` field. Block ids and slots travel as packed
  little-endian int64. Decoding a list of Python ints costs ~15 ns per element; a
  packed field costs nothing until it is used (research/stack.md section 4).
  ``kvoffload.protocol.packing`` packs and splits them.
- File descriptors never appear here: a message says how many it expects
  (``AttachWorker.caches[i].fd_index``) and the I/O layer moves them with SCM_RIGHTS.
- Every field of a request whose size the sender chooses (text, bytes, lists) carries
  its bound in its type (``msgspec.Meta(max_length=...)``): the decoder refuses a
  longer one before any handler sees it, so what a request can make the daemon hold or
  walk is bounded by its schema, not by each handler remembering to check.
  ``tests/unit/test_protocol_bounds.py`` walks every request type and fails on a field
  without one.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

PROTOCOL_VERSION = 8
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_KEY_BYTES = 64
MAX_KEYS_PER_MESSAGE = 65536  # bounds the loop time one request can take
# keys a request that changes blocks' state names at most (prepare/complete of stores
# and loads cost the daemon microseconds per key: a larger call goes in several)
MAX_STATE_KEYS = 8192
# Bounds of the request fields whose size the sender chooses (see the module's rules).
MAX_TEXT_CHARS = 4096  # a namespace name, a model id (a path), a dtype, a salt
MAX_CLIENT_NAME_CHARS = 256  # kept per connection for as long as it lasts
MAX_IDS_PER_MESSAGE = 1 << 20  # block ids or slots (packed int64) in one field
MAX_TENSORS = 4096  # KV tensors of one rank's layout, caches of one worker
MAX_HANDLE_BYTES = 256  # a CUDA IPC handle (64 bytes), a device UUID (16)
MAX_FRAGMENTS = 1 << 16  # a canonical cache's fragments (packed int64 triples)
MAX_JOB_IDS = 1 << 16  # jobs one WaitJobs names


def at_most(n: int) -> msgspec.Meta:
    return msgspec.Meta(max_length=n)


Text = Annotated[str, at_most(MAX_TEXT_CHARS)]
Keys = Annotated[bytes, at_most(MAX_KEYS_PER_MESSAGE * MAX_KEY_BYTES)]  # packed keys
Ids = Annotated[bytes, at_most(MAX_IDS_PER_MESSAGE * 8)]  # packed int64
Handle = Annotated[bytes, at_most(MAX_HANDLE_BYTES)]
Indexes = Annotated[list[int], at_most(MAX_TENSORS)]  # of a worker's caches
KEY_ABSENT, KEY_READY, KEY_PROMOTING = 0, 1, 2  # ProbeReply states


class Message(msgspec.Struct, frozen=True, array_like=True, tag_field="t", omit_defaults=False):
    """A request, reply or push: tagged (``t``), its fields in wire order."""


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """How one engine's KV blocks look; the namespace fingerprint is derived from it.

    ``tensor_page_bytes`` lists the bytes one engine block occupies in each canonical
    KV tensor of one rank. One offloaded block holds ``block_size_factor`` engine blocks
    of every tensor of every one of the ``world_size`` ranks.
    """

    tensor_page_bytes: Annotated[list[int], at_most(MAX_TENSORS)]
    world_size: int = 1
    block_size_factor: int = 1
    model: Text = ""
    kv_dtype: Text = ""
    salt: Text = ""

    @property
    def rank_bytes(self) -> int:
        """Bytes of one rank's share of one offloaded block."""
        return sum(self.tensor_page_bytes) * self.block_size_factor

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block, all ranks together (before slot alignment)."""
        return self.rank_bytes * self.world_size

    def fingerprint(self) -> str:
        """The namespace fingerprint: a hash of the layout's wire encoding."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]
