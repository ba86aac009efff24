"""The daemon trusts no pre-existing object: directory, lock, socket, region, tier file.

Anything that was there before the daemon (another daemon, another uid, a crash, an
attacker planting files in /tmp or /dev/shm) is checked before use:

- A directory the daemon creates or uses (socket and lock, disk tier) must be a real
  directory (never a symlink), owned by the daemon's uid (or root, for system
  directories like /run), and writable by nobody else; a missing one is created 0750
  (0700 for tier data). Its ancestors too must be owned by the daemon's uid or root
  and writable by nobody else, unless root-owned and sticky (/tmp): nobody else can
  rename a checked directory away and put their own in its place.
- Files are opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the descriptor
  (type, owner, mode), never by path, so nothing can be swapped between check and use.
- A shared-memory region is adopted only if it is a regular file owned by the
  daemon's uid with no group or other permission bits (``check_private_file``).
- One instance owns one region and one socket: the daemon holds an exclusive ``flock``
  on the region itself for its lifetime, another on ``<socket>.lock`` and another on
  its region's record (regionstate.py); a socket path something still answers on is
  never unlinked.
- Every refusal says what was found and what to do about it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import resource
import socket
import stat


class UntrustedError(RuntimeError):
    """A pre-existing object failed its checks; the message says which and why."""


def _describe(st: os.stat_result) -> str:
    kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISFIFO(st.st_mode):
        kind = "fifo"
    elif stat.S_ISSOCK(st.st_mode):
        kind = "socket"
    return f"a {kind} owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}"


def secure_dir(path: str, mode: int = 0o750) -> None:
    """Create ``path`` (and parents, as needed) or verify an existing one."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(path.rstrip("/"))
        if not parent or parent == path:
            raise
        secure_dir(parent, mode)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
    st = os.lstat(path)
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (me, 0):
        raise UntrustedError(
            f"{path} is {_describe(st)}; kvoffloadd (uid {me}) needs its own directory "
            "there: remove it, or choose another path"
        )
    _not_writable_by_others(path, st)
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        pst = os.stat(parent)
        if pst.st_uid not in (me, 0):
            raise UntrustedError(
                f"{parent}, above {path}, is {_describe(pst)}: its owner could replace "
                f"{path}; choose a path under directories of root or uid {me}"
            )
        _not_writable_by_others(parent, pst)
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def _not_writable_by_others(path: str, st: os.stat_result) -> None:
    if st.st_mode & 0o022 and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        raise UntrustedError(
            f"{path} is writable by others ({_describe(st)}), who could replace what "
            "kvoffloadd keeps there; chmod go-w it, or choose another path"
        )


def check_private_file(
    fd: int, what: str, remedy: str = "remove it, or start with --discard-region"
) -> os.stat_result:
    """A descriptor's file must be regular, ours, and closed to group and others."""
    st = os.fstat(fd)
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        raise UntrustedError(
            f"{what} is {_describe(st)}; kvoffloadd only uses one it created itself "
            f"(uid {me}, mode 0600): {remedy}"
        )
    return st


class FileLock:
    """An exclusive ``flock`` on a private file, held for the daemon's lifetime. With
    ``holder_text`` the file says who holds it; without, its content is kept (a record
    the holder reads and rewrites through ``fd``)."""

    def __init__(self, path: str, holder_text: str | None) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedError(f"{path} is a symlink; remove it") from None
            raise
        try:
            check_private_file(self._fd, path, "remove it")
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
            os.close(self._fd)
            raise UntrustedError(
                f"another kvoffloadd holds {path} "
                f"({holder if holder.startswith('pid ') else 'pid unknown'}); stop it, or "
                "pick another --socket / --instance"
            ) from None
        except BaseException:
            os.close(self._fd)
            raise
        if holder_text is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, holder_text.encode(), 0)

    @property
    def fd(self) -> int:
        return self._fd

    def release(self, unlink: bool = True) -> None:
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self._fd)


def lock_region(fd: int, name: str) -> None:
    """One daemon per region, whatever its socket: a lock on the segment itself."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UntrustedError(
            f"region {name} is in use by another kvoffloadd; two daemons never share one "
            "(stop the other, or pick another --instance)"
        ) from None


def socket_in_use(path: str) -> bool:
    """Whether something still answers on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError as exc:
        return exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK)
    finally:
        probe.close()
    return True


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft
