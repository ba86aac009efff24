"""Authenticated tier blocks: a keyed MAC over every block a tier holds.

Tiers are shared (several nodes' daemons, one Redis, one Mooncake cluster, sometimes
one directory), so anything that can write there could otherwise feed KV to every
engine that loads it. A CRC proves nothing: anyone can compute one.

Rules:
- The secret is 32 random bytes, kept as 64 hex digits in ``tier_secret_file``: one
  per deployment, the same file on every daemon that shares a tier. It is read only
  through a descriptor opened ``O_NOFOLLOW`` and checked on that descriptor (a regular
  file owned by the daemon's uid, no group or other bits), in a directory nobody else
  can change (``trust.secure_dir``). Absent, it is generated: written ``O_EXCL |
  O_NOFOLLOW`` 0600 under a temporary name, flushed, and linked into place (a daemon
  that loses that race reads the winner's).
- Two keys are derived from it with BLAKE3's key derivation: the MAC key, and a key
  id (8 bytes) written beside each tag, so a reader tells a block sealed under another
  secret (a node with a different file: said once in the log) from a forged or damaged
  one. The key id reveals nothing usable about the secret.
- The MAC is keyed BLAKE3 (32 bytes) over the namespace's identity (name and layout
  fingerprint), the key, the block's length and its bytes, so a block copied to
  another key or namespace (a replay) fails like a forged one. Tags are compared in
  constant time (``hmac.compare_digest``).
- A seal (56 bytes: tier magic, key id, block bytes, tag) travels with each block.
  A block is accepted only with this tier's magic, this secret's key id, its exact
  length and a tag that verifies over the bytes as they lie in the region slot after
  the copy. Anything else is a miss, counted per reason; each reason is logged once per
  tier. Blocks of the formats before (a CRC, no MAC) are refused like the rest.
- Hashing runs on the tiers' threads (BLAKE3 releases the GIL); where a tier copies a
  block itself it hashes each piece just after copying it, while it is in the cache
  (``copy_and_hash``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hmac
import logging
import os
import secrets
import struct
import threading
from collections import Counter
from typing import Any

import blake3

from kvoffloadd.tiers.base import TierError, TierNamespace, auth_statistics
from kvoffloadd.trust import UntrustedError, check_private_file, secure_dir

log = logging.getLogger(__name__)

SECRET_BYTES = 32
_MAC_CONTEXT = "kvoffload 2026-11 tier block MAC"
_KEY_ID_CONTEXT = "kvoffload 2026-11 tier key id"
TAG_BYTES = 32
SEAL = struct.Struct("<8s8sQ32s")  # tier magic, key id, block bytes, tag
_PREFIX = b"KVOTAG01"  # the MAC's first input (a format version of what it covers)
# Copied (or read) then hashed while it is in the cache, and few pieces a block: every
# piece takes the GIL twice, against the daemon's loop. Pieces of 256 KiB (the L2 of the
# benchmark machine's cores) promoted 10-20% slower than these (docs/performance.md).
PIECE_BYTES = 1 << 20


def read_secret(path: str) -> bytes:
    """The tier secret in ``path``, generated there first if absent; ``TierError`` says
    what is wrong with a file or directory that cannot be trusted."""
    path = os.path.abspath(path)
    try:
        secure_dir(os.path.dirname(path), 0o700)
        fd = _open_secret(path)
        if fd is None:
            _generate(path)
            fd = _open_secret(path)
            assert fd is not None
        try:
            check_private_file(fd, f"tier_secret_file {path}", "chown and chmod 0600 it")
            text = os.read(fd, 256)
        finally:
            os.close(fd)
    except UntrustedError as exc:
        raise TierError(f"tier_secret_file: {exc}") from None
    except OSError as exc:
        raise TierError(
            f"tier_secret_file {path}: {exc.strerror}; set tier_secret_file to a file "
            "kvoffloadd's user may create or read"
        ) from None
    digits = text.strip()
    if len(digits) != 2 * SECRET_BYTES or not all(c in b"0123456789abcdefABCDEF" for c in digits):
        raise TierError(
            f"tier_secret_file {path} must hold {2 * SECRET_BYTES} hex digits "
            "(openssl rand -hex 32 > FILE)"
        )
    return bytes.fromhex(digits.decode())


def _open_secret(path: str) -> int | None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TierError(
                f"tier_secret_file {path} is a symlink; kvoffloadd follows none"
            ) from None
        raise


def _generate(path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)
            log.warning(
                "generated a tier secret in %s: every daemon that shares a tier with this "
                "one needs a copy of this file (docs/tiers.md: the secret)",
                path,
            )
        except FileExistsError:
            pass  # another daemon made one meanwhile: it is read instead
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class BlockMac:
    """The MAC of one deployment's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a tier secret is {SECRET_BYTES} bytes")
        self._key = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
        self.key_id = blake3.blake3(secret, derive_key_context=_KEY_ID_CONTEXT).digest(8)

    def hasher(self, ns: TierNamespace, key: bytes, nbytes: int) -> Any:
        """A keyed BLAKE3 state that has taken everything but the block's bytes."""
        name, fp = ns.name.encode(), ns.fingerprint.encode()
        head = b"".join(
            (
                _PREFIX,
                struct.pack("<I", len(name)),
                name,
                struct.pack("<I", len(fp)),
                fp,
                struct.pack("<I", len(key)),
                key,
                struct.pack("<Q", nbytes),
            )
        )
        return blake3.blake3(head, key=self._key)

    def tag(self, ns: TierNamespace, key: bytes, data: Any) -> bytes:
        h = self.hasher(ns, key, len(memoryview(data)))
        h.update(data)
        digest: bytes = h.digest()
        return digest

    def seal(self, magic: bytes, ns: TierNamespace, key: bytes, data: Any) -> bytes:
        nbytes = len(memoryview(data))
        return SEAL.pack(magic, self.key_id, nbytes, self.tag(ns, key, data))

    def copy_and_hash(
        self, ns: TierNamespace, key: bytes, dst: memoryview, dst_address: int, src_address: int
    ) -> bytes:
        """Copy ``len(dst)`` bytes from ``src_address`` to ``dst`` (at ``dst_address``)
        and return the tag of what landed there, each piece hashed just after its copy."""
        n = len(dst)
        h = self.hasher(ns, key, n)
        for at in range(0, n, PIECE_BYTES):
            size = min(PIECE_BYTES, n - at)
            ctypes.memmove(dst_address + at, src_address + at, size)
            h.update(dst[at : at + size])
        digest: bytes = h.digest()
        return digest

    def read_and_hash(
        self, ns: TierNamespace, key: bytes, dst: memoryview, fd: int, offset: int
    ) -> bytes | None:
        """Read ``len(dst)`` bytes of ``fd`` from ``offset`` into ``dst`` and return the
        tag of what landed there, each piece hashed just after its read (None: the file
        ends first). The disk tier's promotion, and the benchmark's measure of it."""
        n = len(dst)
        h = self.hasher(ns, key, n)
        for at in range(0, n, PIECE_BYTES):
            piece = dst[at : at + PIECE_BYTES]
            if os.preadv(fd, (piece,), offset + at) != len(piece):
                return None
            h.update(piece)
        digest: bytes = h.digest()
        return digest


class SealCheck:
    """One tier's checks of the seals it reads back, with their counts (any thread)."""

    def __init__(self, mac: BlockMac, tier: str, magic: bytes) -> None:
        assert len(magic) == 8
        self.mac = mac
        self.tier = tier
        self.magic = magic
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def seal(self, ns: TierNamespace, key: bytes, data: Any) -> bytes:
        return self.mac.seal(self.magic, ns, key, data)

    def check_head(self, seal: Any, nbytes: int, what: str) -> bool:
        """Everything but the tag: a block that fails here need not be read at all."""
        raw = bytes(seal) if seal is not None else b""
        if len(raw) != SEAL.size or raw[:8] != self.magic:
            family = raw[:6] == self.magic[:6]
            return self.refuse("unauthenticated" if family else "bad_seal", what)
        _, key_id, size, _ = SEAL.unpack(raw)
        if key_id != self.mac.key_id:
            return self.refuse("other_secret", what, key_id)
        if size != nbytes:
            return self.refuse("bad_seal", what)
        return True

    def check(
        self, seal: Any, ns: TierNamespace, key: bytes, data: Any, what: str, tag: bytes = b""
    ) -> bool:
        """Is ``data`` the block ``seal`` vouches for, at this key of this namespace?
        ``tag``: the MAC of ``data`` when the caller computed it while copying."""
        nbytes = len(memoryview(data))
        if not self.check_head(seal, nbytes, what):
            return False
        return self.check_tag(seal, tag or self.mac.tag(ns, key, data), what)

    def check_tag(self, seal: Any, tag: bytes, what: str) -> bool:
        """The tag of a seal that passed ``check_head`` against ``tag``, the MAC of the
        bytes as they lie in the slot."""
        expected = SEAL.unpack(bytes(seal))[3]
        return hmac.compare_digest(expected, tag) or self.refuse("bad_mac", what)

    def refuse(self, reason: str, what: str, key_id: bytes = b"") -> bool:
        with self._lock:
            self._counts[reason] += 1
            first = self._counts[reason] == 1
        if first:
            why, more = _WHY[reason], _MORE[reason]
            log.warning("tier %s: %s (%s); not loaded%s", self.tier, why, what, more)
            if key_id:
                log.warning(
                    "tier %s: that block's key id is %s, this daemon's %s",
                    self.tier,
                    key_id.hex(),
                    self.mac.key_id.hex(),
                )
        return False

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return auth_statistics(dict(self._counts))


_WHY = {
    "other_secret": "a block sealed with another tier secret",
    "bad_mac": "a block whose MAC does not verify (forged, replayed from another key, or damaged)",
    "unauthenticated": "a block of an older format, without a MAC",
    "bad_seal": "a block without a valid seal",
}
_MORE = {
    "other_secret": "; every daemon sharing this tier needs the same tier_secret_file "
    "(further such blocks are counted, not logged)",
    "bad_mac": " (further ones are counted in auth_bad_mac_total, not logged)",
    "unauthenticated": "; it is replaced when an engine stores that block again "
    "(further ones are counted, not logged)",
    "bad_seal": " (further ones are counted, not logged)",
}
