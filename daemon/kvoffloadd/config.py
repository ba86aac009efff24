"""Daemon configuration: one typed record, embedded defaults, TOML file, flag overrides.

Rules:
- Every key has a default, so the daemon starts with no file at all.
- Unknown keys and bad values are refused at start with the key, the value and what
  is allowed (msgspec validation, plus the checks in ``validate``).
- Precedence: defaults < config file < command-line flags. Without ``--config`` the
  daemon reads ``/etc/kvoffload/kvoffloadd.toml`` if it exists, else runs on defaults.
- Sizes accept integers (bytes) or strings with a binary unit: "1GiB", "512MiB".
"""

from __future__ import annotations

import fnmatch
import mmap
import os
import re
import sys
from typing import Any

import msgspec

from kvoffload.paths import default_socket_path
from kvoffloadd.access import AccessPolicy, NamespaceRule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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

    pattern: str
    max_region_size: int | str = 0  # 0: unlimited
    max_pinned_blocks: int = 0  # 0: unlimited

    @property
    def max_region_bytes(self) -> int:
        if self.max_region_size in (0, "0"):
            return 0
        return parse_size(self.max_region_size, "namespace_quotas.max_region_size")


class TierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One secondary tier below the region (``[[tiers]]`` in the file, fastest first)."""

    type: str  # "disk", "redis" or "mooncake"
    name: str = ""  # empty: the type (then "disk2", ... for more of one type)
    capacity: int | str = 0  # disk: required; redis: 0 = Redis's own maxmemory
    path: str = ""  # disk: directory of block files
    url: str = ""  # redis: redis://host:port/db
    threads: int = 4  # disk: I/O threads; redis: connections; mooncake: job threads
    fsync: bool = False  # disk: fsync each file (survive power loss, slower)
    verify: bool = True  # older configs: every block's MAC is always checked now
    ttl_s: float = 0.0  # redis: expire blocks after this long (0: never)
    prefix: str = "kvoffload"  # redis, mooncake: key prefix (daemons sharing blocks use one)
    chunk_size: int | str = "8MiB"  # redis: unused since blocks are one field (old configs)
    timeout_s: float = 2.0  # redis: connect and command timeout; mooncake: transfer hold
    refresh_s: float = 0.2  # redis, mooncake: how often other daemons' blocks are picked up
    full_sync_s: float = 10.0  # redis, mooncake: how often the whole store is re-read
    master: str = ""  # mooncake: host:port of mooncake_master
    metadata_server: str = ""  # mooncake: http://host:port/metadata (or etcd://...)
    local_hostname: str = "127.0.0.1"  # mooncake: the address other nodes reach this one at
    protocol: str = "tcp"  # mooncake: "tcp" or "rdma"
    device: str = ""  # mooncake: RDMA device names, with protocol "rdma"
    segment_size: int | str = "512MiB"  # mooncake: memory this daemon lends the store (0: none)
    local_buffer_size: int | str = "16MiB"  # mooncake: the client's staging buffer
    admin_url: str = ""  # mooncake: http://host:port of the master's admin server
    lease_ttl_s: float = 10.0  # mooncake: the master's -default_kv_lease_ttl (0: off)
    max_view_blocks: int = 262_144  # redis, mooncake: blocks of the store the daemon follows

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
        if self.type not in ("disk", "redis", "mooncake"):
            raise ConfigError(f"{where}.type: {self.type!r} is not one of disk, redis, mooncake")
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


class DaemonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    instance: str = "default"
    socket: str = ""  # empty: default_socket_path(instance)
    region_size: int | str = "1GiB"
    extent_size: int | str = 0  # 0: about 64 extents per region
    min_slot_size: int | str = "16KiB"
    policy: str = "lru"
    copy_threads: int = 2
    log_level: str = "info"
    max_frame_bytes: int = 16 * 1024 * 1024
    max_clients: int = 1024
    max_namespaces_per_uid: int = 32  # 0: unlimited; root and the daemon's uid never are
    # share of a namespace's largest size one client may have in flight (being
    # written or leased empty); all clients together 1.5 times that; 1: no limit
    max_writing_fraction: float = 0.5
    # requests not yet complete and replies not yet sent, all clients together; the
    # largest holder is cut off beyond it
    buffer_budget: int | str = "256MiB"
    prefault: bool = True
    # threads that populate (pre-fault) the region; 0: one per CPU the daemon may use
    # (its affinity and cgroup CPU quota), at most one per GiB of region
    populate_threads: int = 0
    # the unit in which the region is populated, page-locked, placed and made ready
    populate_chunk_size: int | str = "2GiB"
    # "auto": on a machine of several NUMA nodes, one part of the region per node with
    # GPUs, sized by its GPUs and populated by threads bound to it; "off": no placement
    numa: str = "auto"
    # "off": 4 KiB pages in /dev/shm; "2M" or "1G": hugetlbfs huge pages (reserved
    # with nr_hugepages); "thp": transparent huge pages of a tmpfs mounted with huge=
    huge_pages: str = "off"
    # directory of the region's file; empty: /dev/shm, or the first hugetlbfs mount of
    # the huge page size
    region_dir: str = ""
    # memory the daemon needs beyond its region (heap, buffers), for the start check
    memory_headroom: int | str = "1GiB"
    # refuse to start when a cgroup memory limit, the host's memory, the region's
    # filesystem or the free huge pages cannot hold the region (no OOM kill later)
    check_memory_limits: bool = True
    gpu: str = "auto"  # "auto": copy for CUDA engines when a driver and GPU exist; "off"
    # page-lock the region for GPU DMA (background, chunk by chunk as it is populated)
    pin_region: bool = True
    keep_region: bool = False  # a clean stop leaves the region for the next daemon
    # the daemon's private state (which segment is its region); empty: the socket's
    # directory. It must live as long as the region does (regionstate.py)
    state_dir: str = ""
    discard_region: bool = False  # drop an existing region that cannot be recovered
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_address: str = "127.0.0.1"
    # namespace names as metric labels (any local user can read the metrics port)
    metrics_namespace_labels: bool = False
    # uids allowed to evict and read the config; unset: root and the daemon's own uid
    admin_uids: list[int] | None = None
    admin_gids: list[int] = msgspec.field(default_factory=list)
    # who may connect; both unset: whoever can reach the socket (see access.py)
    allow_uids: list[int] | None = None
    allow_gids: list[int] | None = None
    namespace_access: list[NamespaceRule] = msgspec.field(default_factory=list)
    namespace_quotas: list[NamespaceQuota] = msgspec.field(default_factory=list)
    # copy jobs one connection may have in flight (a uid 4x, everyone 16x; 0: no limit)
    max_inflight_jobs_per_client: int = 4096
    # pins one connection may hold on blocks (a uid 4x, everyone 16x; 0: no limit)
    max_pins_per_client: int = 1 << 20
    verify_checksums: bool = False  # CRC32 per stored block, checked on every load
    # evicted blocks stay loadable this long for engines' key mirrors (graves.py)
    mirror_grace_s: float = 1.0
    # a committed store whose copies have not all landed by then is dropped
    commit_timeout_s: float = 30.0
    # a pin held longer is dropped (a load takes a step): nobody keeps a block for good
    pin_timeout_s: float = 60.0
    # who may map the region for client-copy workers; unset: root and the daemon's uid
    client_copy_uids: list[int] | None = None
    client_copy_gids: list[int] = msgspec.field(default_factory=list)
    # secondary tiers, fastest first; blocks cascade down and are promoted back
    tiers: list[TierConfig] = msgspec.field(default_factory=list)
    tier_max_inflight_blocks: int = 256  # per tier: region blocks pinned for cascades
    tier_job_timeout_s: float = 30.0  # a tier with a job older than this is stalled
    # the per-deployment secret that seals tier blocks (64 hex digits; generated when
    # absent); empty: tier-secret in $STATE_DIRECTORY, else in /var/lib/kvoffload
    tier_secret_file: str = ""

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path(self.instance)

    @property
    def region_bytes(self) -> int:
        return parse_size(self.region_size, "region_size")

    @property
    def buffer_budget_bytes(self) -> int:
        return parse_size(self.buffer_budget, "buffer_budget")

    @property
    def min_slot_bytes(self) -> int:
        return parse_size(self.min_slot_size, "min_slot_size")

    @property
    def extent_bytes(self) -> int:
        if self.extent_size in (0, "0"):
            from kvoffloadd.region.region import default_extent_bytes

            return max(default_extent_bytes(self.region_bytes), self.page_bytes)
        return parse_size(self.extent_size, "extent_size")

    @property
    def page_bytes(self) -> int:
        """The region's page size: the huge page size with hugetlbfs."""
        from kvoffloadd.region.backing import HUGE_PAGE_BYTES

        return HUGE_PAGE_BYTES.get(self.huge_pages, mmap.PAGESIZE)

    @property
    def populate_chunk_bytes(self) -> int:
        return parse_size(self.populate_chunk_size, "populate_chunk_size")

    @property
    def memory_headroom_bytes(self) -> int:
        if self.memory_headroom in (0, "0"):
            return 0
        return parse_size(self.memory_headroom, "memory_headroom")

    @property
    def tier_secret_path(self) -> str:
        if self.tier_secret_file:
            return self.tier_secret_file
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0] or "/var/lib/kvoffload"
        return os.path.join(state, "tier-secret")

    @property
    def region_name(self) -> str:
        """The region's public prefix: the daemon's region adds a random part, recorded
        in ``state_dir`` (regionstate.py); tests and tools map this name itself."""
        return f"/kvoffload-{self.instance}"

    @property
    def state_path(self) -> str:
        return self.state_dir or os.path.dirname(os.path.abspath(self.socket_path))

    def validate(self) -> DaemonConfig:
        from kvoffloadd.index.policies import POLICIES

        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.instance):
            raise ConfigError(
                f"instance: {self.instance!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        self.region_bytes  # noqa: B018 - parse for the error message
        if self.state_dir and not os.path.isabs(self.state_dir):
            raise ConfigError(f"state_dir: {self.state_dir!r} is not an absolute path")
        if self.buffer_budget_bytes < 2 * self.max_frame_bytes:
            raise ConfigError(
                f"buffer_budget: {self.buffer_budget} must hold at least two frames of "
                f"max_frame_bytes ({self.max_frame_bytes})"
            )
        self.min_slot_bytes  # noqa: B018
        self.extent_bytes  # noqa: B018
        if self.policy not in POLICIES:
            raise ConfigError(
                f"policy: {self.policy!r} is not one of {', '.join(sorted(POLICIES))}"
            )
        if not 1 <= self.copy_threads <= 64:
            raise ConfigError(f"copy_threads: {self.copy_threads} is not in 1..64")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                f"log_level: {self.log_level!r} is not one of debug, info, warning, error"
            )
        if self.gpu not in ("auto", "off"):
            raise ConfigError(f"gpu: {self.gpu!r} is not one of auto, off")
        self._validate_region_placement()
        if self.max_frame_bytes < 4096:
            raise ConfigError(f"max_frame_bytes: {self.max_frame_bytes} is below 4096")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: {self.metrics_port} is not in 0..65535")
        for q in self.namespace_quotas:
            q.max_region_bytes  # noqa: B018 - parse for the error message
            if q.max_pinned_blocks < 0:
                raise ConfigError(
                    f"namespace_quotas.max_pinned_blocks: {q.max_pinned_blocks} is negative"
                )
        for key in ("max_inflight_jobs_per_client", "max_pins_per_client"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: {getattr(self, key)} is negative")
        if self.max_clients < 1:
            raise ConfigError(f"max_clients: {self.max_clients} is below 1")
        seen: dict[str, int] = {}
        for t in self.tiers:
            if not t.name:
                seen[t.type] = seen.get(t.type, 0) + 1
                t.name = t.type if seen[t.type] == 1 else f"{t.type}{seen[t.type]}"
            t.validate()
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")
        if not 0 < self.tier_job_timeout_s <= 3600:
            raise ConfigError(f"tier_job_timeout_s: {self.tier_job_timeout_s} is not in (0, 3600]")
        if self.tier_max_inflight_blocks < 1:
            raise ConfigError(
                f"tier_max_inflight_blocks: {self.tier_max_inflight_blocks} is below 1"
            )
        if not 0 < self.max_writing_fraction <= 1:
            raise ConfigError(f"max_writing_fraction: {self.max_writing_fraction} is not in (0, 1]")
        if not 1 <= self.pin_timeout_s <= 3600:
            raise ConfigError(f"pin_timeout_s: {self.pin_timeout_s} is not in [1, 3600]")
        if not 0 < self.commit_timeout_s <= 3600:
            raise ConfigError(f"commit_timeout_s: {self.commit_timeout_s} is not in (0, 3600]")
        if not 0 <= self.mirror_grace_s <= 60:
            raise ConfigError(f"mirror_grace_s: {self.mirror_grace_s} is not in 0..60")
        return self

    def _validate_region_placement(self) -> None:
        from kvoffloadd.region.backing import HUGE_PAGES

        if not 0 <= self.populate_threads <= 1024:
            raise ConfigError(f"populate_threads: {self.populate_threads} is not in 0..1024")
        if not 2 << 20 <= self.populate_chunk_bytes <= 64 << 30:
            raise ConfigError(
                f"populate_chunk_size: {self.populate_chunk_size!r} is not between 2MiB and "
                "64GiB (2GiB or less keeps other processes' CUDA calls from stalling on a pin)"
            )
        if self.numa not in ("auto", "off"):
            raise ConfigError(f"numa: {self.numa!r} is not one of auto, off")
        if self.huge_pages not in HUGE_PAGES:
            raise ConfigError(
                f"huge_pages: {self.huge_pages!r} is not one of {', '.join(HUGE_PAGES)}"
            )
        if self.region_dir and not os.path.isabs(self.region_dir):
            raise ConfigError(f"region_dir: {self.region_dir!r} is not an absolute path")
        self.memory_headroom_bytes  # noqa: B018 - parse for the error message
        if self.extent_bytes % self.page_bytes:
            raise ConfigError(
                f"extent_size: {self.extent_size!r} is not a multiple of the {self.huge_pages} "
                "huge page size"
            )

    def quota_for(self, namespace: str) -> NamespaceQuota | None:
        for q in self.namespace_quotas:
            if fnmatch.fnmatchcase(namespace, q.pattern):
                return q
        return None

    def access_policy(self) -> AccessPolicy:
        return AccessPolicy(
            self.allow_uids,
            self.allow_gids,
            self.admin_uids,
            self.admin_gids,
            self.namespace_access,
            self.client_copy_uids,
            self.client_copy_gids,
        )

    def effective(self) -> dict[str, Any]:
        """Every key with its effective value, sizes in bytes."""
        out: dict[str, Any] = msgspec.structs.asdict(self)
        out.update(
            socket=self.socket_path,
            region_size=self.region_bytes,
            extent_size=self.extent_bytes,
            min_slot_size=self.min_slot_bytes,
            populate_chunk_size=self.populate_chunk_bytes,
            memory_headroom=self.memory_headroom_bytes,
        )
        return out


DEFAULT_CONFIG_PATH = "/etc/kvoffload/kvoffloadd.toml"


def load_config(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``."""
    data: dict[str, Any] = {}
    if path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        path = DEFAULT_CONFIG_PATH
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(data, DaemonConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    return cfg.validate()
