"""The daemon trusts no pre-existing object: directory, lock, socket, region, tier file.

Anything that was there before the daemon (another daemon, another uid, a crash, an
attacker planting files in /tmp or /dev/shm) is checked before use:

- A directory the daemon creates or uses (socket and lock, disk tier) must be a real
  directory (never a symlink), owned by the daemon's uid (or root, for system
  directories like /run), and writable by nobody else; a missing one is created 0750
  (0700 for tier data). Its ancestors too must be owned by the daemon's uid or root
  and writable by nobody else, unless root-owned and sticky (/tmp): nobody else can
  rename a checked directory away and put their own in its place.
- A disk tier's directory is held to more (``private_dir``): it, and every directory
  above it up to one owned by the daemon's uid, may be written by nobody else (a
  sticky /tmp is no exception there: anyone could create entries in it). Only the
  directory itself is created, never its parents; it is opened ``O_NOFOLLOW`` and
  everything under it is reached from its descriptor (``openat``), never by path.
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


def private_dir(path: str) -> int:
    """A descriptor of the directory ``path`` (created 0700 if absent; its parent must
    exist) that nobody but the daemon's uid can change: ``UntrustedError`` names the
    directory that breaks the rules."""
    me = os.geteuid()
    path = os.path.abspath(path)
    parent, name = os.path.split(path.rstrip("/") or "/")
    if not name:
        raise UntrustedError("/ cannot be a tier directory")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        pfd = os.open(parent, flags)
    except FileNotFoundError:
        raise UntrustedError(
            f"{parent}, above {path}, does not exist: create it first (kvoffloadd creates "
            "only the tier directory itself)"
        ) from None
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=pfd)
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=pfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                raise UntrustedError(
                    f"{path} is {_describe(st)}; kvoffloadd needs its own directory there: "
                    "remove it, or choose another path"
                ) from None
            raise
        pst = os.fstat(pfd)
    finally:
        os.close(pfd)
    try:
        st = os.fstat(fd)
        if st.st_uid != me or st.st_mode & 0o022 or (me and st.st_mode & 0o300 != 0o300):
            why = "writable by others, " if st.st_mode & 0o022 else ""
            raise UntrustedError(
                f"{path} is {why}{_describe(st)}; a tier directory must be kvoffloadd's "
                f"own (uid {me}), writable by nobody else: chown and chmod 0700 it, or "
                "choose another path"
            )
        _no_other_writer_above(path, parent, pst, me)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _no_other_writer_above(path: str, parent: str, pst: os.stat_result, me: int) -> None:
    """Directories above a private one: nobody else may write to any of them up to one
    of the daemon's uid (whose entries nobody else can rename: above it, the usual
    rule, where a root-owned sticky directory is fine)."""
    strict = True  # the tier directory itself is the daemon's: its parent decides
    d, st = parent, pst
    real = os.path.realpath(parent)
    while True:
        if st.st_uid not in (me, 0):
            raise UntrustedError(
                f"{d}, above {path}, is {_describe(st)}: its owner could replace {path}; "
                f"choose a path under directories of root or uid {me}"
            )
        if strict and st.st_mode & 0o022:
            raise UntrustedError(
                f"{d}, above {path}, is writable by others ({_describe(st)}): another user "
                f"could put entries there; nobody but uid {me} may write to a tier "
                "directory or the directories above it up to one of its own"
            )
        _not_writable_by_others(d, st)
        if st.st_uid == me:
            strict = False
        if real == "/":
            return
        real = os.path.dirname(real)
        d, st = real, os.stat(real)


def _not_writable_by_others(path: str, st: os.stat_result) -> None:
    if st.st_mode & 0o022 and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        raise UntrustedError(
            f"{path} is writable by others ({_describe(st)}), who could replace what "
            "kvoffloadd keeps there; chmod go-w it, or choose another path"
        )


def check_private_file(
    fd: int, what: str, fix: str = "remove it, or start with --discard-region"
) -> os.stat_result:
    """A descriptor's file must be regular, ours, and closed to group and others."""
    st = os.fstat(fd)
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        raise UntrustedError(
            f"{what} is {_describe(st)}; kvoffloadd only uses one it created itself "
            f"(uid {me}, mode 0600): {fix}"
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
