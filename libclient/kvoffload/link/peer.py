"""Which process a client agrees to talk to: the daemon's identity, from the kernel.

An engine hands the daemon its KV caches (memfds, CUDA IPC handles) and its keys, so a
socket planted by another local user must never get them: with ``XDG_RUNTIME_DIR``
unset the default socket lives under ``/tmp``, where anyone can create the directory
first. After connecting, the client reads the peer's uid with SO_PEERCRED and accepts:

- root, or its own uid;
- a uid listed in ``$KVOFFLOAD_DAEMON_UIDS`` (comma-separated);
- the uid owning the socket's directory (a service user such as ``kvoffload``), when
  that directory is writable by nobody else and sits in a directory that only root
  can write: the directory was made by root or by the service, never by another user.

Anything else is refused with the uid found and how to trust it.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from kvoffload.protocol.errors import PermissionDeniedError


class UntrustedDaemonError(PermissionDeniedError):
    """The process at the socket is not one this client trusts with its caches."""


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    )
    return int(uid)


def trusted_uids() -> set[int]:
    uids = {0, os.geteuid()}
    for part in os.environ.get("KVOFFLOAD_DAEMON_UIDS", "").split(","):
        if part.strip().isdigit():
            uids.add(int(part))
    return uids


def check_daemon(sock: socket.socket, path: str) -> None:
    """Raise UntrustedDaemonError unless the peer on ``sock`` may be trusted."""
    uid = peer_uid(sock)
    if uid in trusted_uids() or _service_dir_owner(path) == uid:
        return
    raise UntrustedDaemonError(
        f"the process serving {path} runs as uid {uid}, which this client does not "
        "trust with its KV caches (not root, not this uid, not the owner of a "
        "root-made directory); if it is your kvoffloadd, add its uid to "
        "KVOFFLOAD_DAEMON_UIDS"
    )


def _service_dir_owner(path: str) -> int | None:
    """The owner of the socket's directory if only it (and root) could have made and
    filled it, else None."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.lstat(directory)
        parent = os.stat(os.path.dirname(directory))
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        return None
    if parent.st_uid != 0 or parent.st_mode & 0o022:
        return None  # e.g. under /tmp: anyone could have made the directory
    return st.st_uid
