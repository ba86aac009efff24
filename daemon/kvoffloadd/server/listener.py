"""The control socket: bound where only the daemon's group reaches it, and who is on the
other end of each connection.

Rules:
- The socket's directory is made 0750 and checked (``trust.secure_dir``); the socket
  is 0660 (bound under umask 0117, so it is never wider for a moment). A stale socket
  is replaced; one that something still answers on, or anything that is not a socket,
  is refused.
- A peer is who the kernel says it is (``SO_PEERCRED``), never what it says.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from kvoffloadd.trust import UntrustedError, secure_dir, socket_in_use

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
LISTEN_BACKLOG = 512


def bind_listener(path: str) -> socket.socket:
    """Bind the control socket: 0750 directory, 0660 socket. A stale socket is replaced;
    one something still answers on, or anything that is not a socket, is not."""
    secure_dir(os.path.dirname(os.path.abspath(path)))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise UntrustedError(f"{path} exists and is not a socket; remove it")
        if socket_in_use(path):
            raise UntrustedError(f"something already serves {path}; stop it first")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o117)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(LISTEN_BACKLOG)
    return sock


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of ``conn``, as the kernel
    recorded them when it connected."""
    pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid, gid
