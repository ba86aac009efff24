"""kvoffload wire protocol: messages, errors and the sans-IO connection state machine.

Imported by the client library, the daemon and the CLI. Imports neither socket nor torch.
"""

from .connection import (
    HEADER_BYTES,
    NEED_DATA,
    ClientConnection,
    NeedData,
    Role,
    ServerConnection,
    State,
    encode_frame,
)
from .errors import ErrorCode, KVOffloadError, ProtocolError, error_for_code
from .messages import PROTOCOL_VERSION, KVLayout, pack_ids, pack_keys, unpack_ids, unpack_keys

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
    "encode_frame",
    "error_for_code",
    "pack_ids",
    "pack_keys",
    "unpack_ids",
    "unpack_keys",
]
