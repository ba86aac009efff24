"""The configuration's tables, apart from the daemon's own keys: ``[[tiers]]``
(``TierConfig``), ``[[namespace_quotas]]`` (``NamespaceQuota``) and ``[limits.<line>]``
(``LineLimits``), and the size parser every size key goes through.

Rules:
- Each table is a ``msgspec.Struct`` that refuses unknown keys; a key's default, type
  and the comment above it are its documentation (``configdoc`` reads them).
- Values are checked by the table's ``validate`` (or read through a property that
  parses them), with the key's full path in the error: ``ConfigError``.
- Sizes accept integers (bytes) or strings with a binary unit: "1GiB", "512MiB".
- ``kvoffloadd.config`` is the one import for all of it: it re-exports what is here.
"""

from __future__ import annotations

import re

import msgspec

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    pass


def parse_size(value: int | str, key: str = "size") -> int:
    """Bytes from an int or a string such as ``1GiB``, ``64MiB``, ``4096``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ConfigError(f"{key}: {value!r} is not a size (examples: 4096, 64MiB, 1GiB)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{key}: size must be positive, got {value!r}")
    return n


class NamespaceQuota(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Limits for namespaces whose name matches ``pattern`` (first match applies)."""

    # glob pattern of the namespace names this quota applies to (the first match decides)
    # example: "*"
    pattern: str
    # the region bytes the namespace's blocks may hold: a full namespace evicts its own
    # blocks first, and if none can go, prepare_store answers QUOTA_EXCEEDED; 0: no limit
    # example: "64GiB"
    max_region_size: int | str = 0
    # blocks pinned by outstanding prepare_load calls (QUOTA_EXCEEDED beyond); 0: no limit
    # example: 100000
    max_pinned_blocks: int = 0

    @property
    def max_region_bytes(self) -> int:
        if self.max_region_size in (0, "0"):
            return 0
        return parse_size(self.max_region_size, "namespace_quotas.max_region_size")


class LineLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Limits of one ledger line (``[limits.<line>]``); 0 keeps the line's default."""

    # what one connection may hold of the line (sizes take units: "64MiB")
    # example: 131072
    per_connection: int | str = 0
    # what all connections of one uid together may hold
    # example: 524288
    per_uid: int | str = 0
    # what everyone together may hold
    # example: 2097152
    total: int | str = 0

    def resolved(self, where: str) -> dict[str, int]:
        """The set limits in units (sizes such as "64MiB" allowed), 0s dropped."""
        out = {}
        for key in ("per_connection", "per_uid", "total"):
            value = getattr(self, key)
            if value not in (0, "0"):
                out[key] = parse_size(value, f"{where}.{key}")
        return out


# The kinds of secondary tier, for ``[[tiers]]``' ``type``: what each one is.
TIER_TYPES = {
    "disk": "one file per block under path, at most capacity bytes, least recently used "
    "first; survives restarts (a restarted daemon finds the files, partial files from a "
    "crash are deleted)",
    "redis": "blocks shared by every daemon (node) pointed at the same server and prefix, "
    "for namespaces with the same name and layout; capacity bounds all daemons' blocks "
    "together; an unreachable server makes the tier miss until it answers again",
    "mooncake": "blocks in a Mooncake Store cluster shared by every daemon pointed at the "
    "same master and prefix; needs pip install 'kvoffload[mooncake]' and Debian's "
    "libibverbs1, librdmacm1 and libnuma1; Mooncake places, leases and evicts the blocks",
}


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One secondary tier below the region (``[[tiers]]`` in the file, fastest first).

    A key's comment starting with tier types and a colon ("disk:", "redis, mooncake:")
    applies to those types only; the others apply to every type.
    """

    # the kind of tier: "disk", "redis" or "mooncake"
    # example: "disk"
    type: str
    # the tier's name in stats, metrics and logs; empty: the type (then "disk2", ... for
    # more tiers of one type)
    name: str = ""
    # the most bytes the tier holds, least recently used blocks leaving first (disk:
    # required; redis: 0 leaves it to Redis's own maxmemory; mooncake: only reported,
    # Mooncake evicts by itself)
    # example: "256GiB"
    capacity: int | str = 0
    # disk: the directory of block files; it and every directory above it must be
    # writable by the daemon's uid alone (under the unit: inside /var/lib/kvoffload)
    # example: "/var/lib/kvoffload/blocks"
    path: str = ""
    # redis: the server, redis://host:port/db (rediss:// and unix:// too)
    # example: "redis://127.0.0.1:6379/0"
    url: str = ""
    # I/O threads of a disk tier, connections of a redis tier, job threads of a mooncake
    # tier (1..64); promoted blocks are copied and verified on tier_threads
    threads: int = 4
    # disk: fsync each block file, so blocks survive power loss too (writes are slower)
    fsync: bool = False
    # kept for older configs: every block's MAC is checked whatever it says
    verify: bool = True
    # redis: expire blocks after this long (0: never)
    ttl_s: float = 0.0
    # redis, mooncake: key prefix; daemons that share blocks use one prefix
    prefix: str = "kvoffload"
    # redis: unused, blocks are stored whole (older configs may keep it)
    chunk_size: int | str = "8MiB"
    # redis, mooncake: connect and command timeout (redis); how long a Mooncake transfer
    # that failed mid-way holds its slots before they are reused (mooncake)
    timeout_s: float = 2.0
    # redis, mooncake: how soon other daemons' blocks become visible here
    refresh_s: float = 0.2
    # redis, mooncake: how often the whole store is re-read, so blocks evicted elsewhere
    # leave this daemon's view
    full_sync_s: float = 10.0
    # mooncake: host:port of mooncake_master's RPC server
    # example: "127.0.0.1:50051"
    master: str = ""
    # mooncake: the metadata server, http://host:port/metadata (or etcd://host:port, or
    # P2PHANDSHAKE)
    # example: "http://127.0.0.1:8080/metadata"
    metadata_server: str = ""
    # mooncake: this node's address as the other nodes reach it
    local_hostname: str = "127.0.0.1"
    # mooncake: "tcp" or "rdma"
    protocol: str = "tcp"
    # mooncake: the RDMA devices to use with protocol "rdma" ("mlx5_0,mlx5_1")
    device: str = ""
    # mooncake: memory this daemon lends the store (0: none; it uses others' segments)
    segment_size: int | str = "512MiB"
    # mooncake: the Mooncake client's staging buffer
    local_buffer_size: int | str = "16MiB"
    # mooncake: http://host:port of the master's admin server; when set, the whole store
    # is listed from it (/get_all_keys)
    admin_url: str = ""
    # mooncake: mooncake_master's -default_kv_lease_ttl (or less): blocks in this
    # daemon's own segment are promoted by its threads while the master's read lease
    # holds them; 0: Mooncake copies every block
    lease_ttl_s: float = 10.0
    # redis, mooncake: blocks of the shared store this daemon follows at most (about
    # 250 B each); beyond it the oldest are forgotten
    max_view_blocks: int = 262_144

    @property
    def capacity_bytes(self) -> int:
        if self.capacity in (0, "0"):
            return 0
        return parse_size(self.capacity, f"tiers.{self.name}.capacity")

    @property
    def segment_bytes(self) -> int:
        """Memory a mooncake tier lends the store; 0: none (it uses others' segments)."""
        if self.segment_size in (0, "0"):
            return 0
        return parse_size(self.segment_size, f"tiers.{self.name}.segment_size")

    @property
    def chunk_bytes(self) -> int:
        return parse_size(self.chunk_size, f"tiers.{self.name}.chunk_size")

    def validate(self) -> None:
        where = f"tiers.{self.name}"
        if self.type not in TIER_TYPES:
            raise ConfigError(f"{where}.type: {self.type!r} is not one of {', '.join(TIER_TYPES)}")
        if self.type == "mooncake":
            self._validate_mooncake(where)
        self.capacity_bytes  # noqa: B018 - parse for the error message
        self.chunk_bytes  # noqa: B018
        if self.type == "disk" and (not self.path or not self.capacity_bytes):
            raise ConfigError(f"{where}: a disk tier needs path and capacity")
        if self.type == "redis" and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"{where}.url: {self.url!r} is not a redis:// URL")
        if not 1 <= self.threads <= 64:
            raise ConfigError(f"{where}.threads: {self.threads} is not in 1..64")
        for key in ("ttl_s", "timeout_s", "refresh_s", "full_sync_s", "lease_ttl_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{where}.{key}: {getattr(self, key)} is negative")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.prefix):
            raise ConfigError(f"{where}.prefix: {self.prefix!r} must be 1-64 plain characters")
        if not 1 <= self.max_view_blocks <= 1 << 26:
            raise ConfigError(f"{where}.max_view_blocks: {self.max_view_blocks} is not in 1..2^26")

    def _validate_mooncake(self, where: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.\[\]:-]+:[0-9]{1,5}", self.master):
            raise ConfigError(f"{where}.master: {self.master!r} is not host:port")
        if not self.metadata_server.startswith(("http://", "etcd://", "P2PHANDSHAKE")):
            raise ConfigError(
                f"{where}.metadata_server: {self.metadata_server!r} is not an http:// "
                "or etcd:// address (or P2PHANDSHAKE)"
            )
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"{where}.protocol: {self.protocol!r} is not tcp or rdma")
        if self.protocol == "rdma" and not self.device:
            raise ConfigError(f"{where}.device: protocol rdma needs the RDMA device names")
        if self.admin_url and not self.admin_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.admin_url: {self.admin_url!r} is not an http:// URL")
        if not self.local_hostname:
            raise ConfigError(f"{where}.local_hostname: empty")
        self.segment_bytes  # noqa: B018 - parse for the error message
        if parse_size(self.local_buffer_size, f"{where}.local_buffer_size") <= 0:
            raise ConfigError(f"{where}.local_buffer_size: must be positive")
