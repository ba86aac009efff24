"""Error codes and exceptions shared by the daemon, the client library and the CLI.

Rules:
- ``ErrorCode`` is append-only: a value, once shipped, keeps its number and meaning,
  because it travels on the wire inside ``ErrorReply``.
- Every exception a client sees is a ``KVOffloadError`` carrying one ``ErrorCode``.
- ``ProtocolError`` is raised by the sans-IO connection when a peer breaks the
  protocol (bad frame, unknown tag, out-of-order message); the I/O layer answers it by
  closing that one connection.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Stable error codes (DESIGN.md section 3). Append only."""

    NO_SPACE = 1
    LAYOUT_MISMATCH = 2
    INVALID_ARGUMENT = 3
    NOT_LEASED = 4
    PERMISSION_DENIED = 5
    VERSION_MISMATCH = 6
    QUOTA_EXCEEDED = 7
    SHUTTING_DOWN = 8
    DAEMON_UNAVAILABLE = 9
    NOT_FOUND = 10
    PROTOCOL_ERROR = 11
    INTERNAL = 12
    TIMED_OUT = 13


class KVOffloadError(Exception):
    """Base of every kvoffload exception; ``code`` says which kind of failure it is."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"[{self.code.name}] {self.args[0]}"


class NoSpaceError(KVOffloadError):
    code = ErrorCode.NO_SPACE


class LayoutMismatchError(KVOffloadError):
    code = ErrorCode.LAYOUT_MISMATCH


class InvalidArgumentError(KVOffloadError):
    code = ErrorCode.INVALID_ARGUMENT


class NotLeasedError(KVOffloadError):
    code = ErrorCode.NOT_LEASED


class PermissionDeniedError(KVOffloadError):
    code = ErrorCode.PERMISSION_DENIED


class VersionMismatchError(KVOffloadError):
    code = ErrorCode.VERSION_MISMATCH


class QuotaExceededError(KVOffloadError):
    code = ErrorCode.QUOTA_EXCEEDED


class ShuttingDownError(KVOffloadError):
    code = ErrorCode.SHUTTING_DOWN


class DaemonUnavailableError(KVOffloadError):
    code = ErrorCode.DAEMON_UNAVAILABLE


class NotFoundError(KVOffloadError):
    code = ErrorCode.NOT_FOUND


class ProtocolError(KVOffloadError):
    """The peer broke the wire protocol; the connection cannot continue."""

    code = ErrorCode.PROTOCOL_ERROR


class InternalError(KVOffloadError):
    code = ErrorCode.INTERNAL


class TimedOutError(KVOffloadError):
    code = ErrorCode.TIMED_OUT


class LoadLostError(KVOffloadError):
    """A load vLLM planned cannot complete, so the engine must stop rather than compute
    with KV it did not load (docs/vllm.md: "What the engine sees when kvoffloadd
    fails")."""

    code = ErrorCode.NOT_FOUND


_BY_CODE: dict[ErrorCode, type[KVOffloadError]] = {
    cls.code: cls
    for cls in (
        NoSpaceError,
        LayoutMismatchError,
        InvalidArgumentError,
        NotLeasedError,
        PermissionDeniedError,
        VersionMismatchError,
        QuotaExceededError,
        ShuttingDownError,
        DaemonUnavailableError,
        NotFoundError,
        ProtocolError,
        InternalError,
        TimedOutError,
    )
}


def error_for_code(code: int, message: str) -> KVOffloadError:
    """Build the typed exception for a wire error code (unknown codes: INTERNAL)."""
    try:
        ecode = ErrorCode(code)
    except ValueError:
        return InternalError(f"unknown error code {code}: {message}")
    return _BY_CODE[ecode](message)
