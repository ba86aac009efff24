"""kvoffload wire protocol: messages, packed fields, errors and the sans-IO connection
state machine.

Rules:
- Imported by the client library, the daemon and the CLI; imports neither socket nor
  torch (ruff bans ``socket`` here).
- Messages evolve by appending fields with defaults; tags never change; a client and a
  daemon of different protocol versions meet ``VERSION_MISMATCH`` at ``Hello``.
"""

from kvoffload.protocol.connection import (
    HEADER_BYTES,
    NEED_DATA,
    ClientConnection,
    NeedData,
    Role,
    ServerConnection,
    State,
    append_frame,
    encode_frame,
    frame_length,
)
from kvoffload.protocol.errors import ErrorCode, KVOffloadError, ProtocolError, error_for_code
from kvoffload.protocol.messages import PROTOCOL_VERSION, KVLayout
from kvoffload.protocol.packing import pack_ids, pack_keys, unpack_ids, unpack_keys

__all__ = [
    "HEADER_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ClientConnection",
    "ErrorCode",
    "KVLayout",
    "KVOffloadError",
    "NeedData",
    "ProtocolError",
    "Role",
    "ServerConnection",
    "State",
    "append_frame",
    "encode_frame",
    "error_for_code",
    "frame_length",
    "pack_ids",
    "pack_keys",
    "unpack_ids",
    "unpack_keys",
]
