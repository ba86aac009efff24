"""Daemon configuration: one typed record, embedded defaults, TOML file, flag overrides.

Rules:
- Every key has a default, so the daemon starts with no file at all.
- Unknown keys and bad values are refused at start with the key, the value and what
  is allowed (``DaemonConfig.validate``).
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
from kvoffloadd.configtables import TIER_TYPES as TIER_TYPES  # re-exported, as below
from kvoffloadd.configtables import ConfigError as ConfigError
from kvoffloadd.configtables import LineLimits as LineLimits
from kvoffloadd.configtables import NamespaceQuota as NamespaceQuota
from kvoffloadd.configtables import TierConfig as TierConfig
from kvoffloadd.configtables import parse_size as parse_size
from kvoffloadd.ledger import SPECS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class DaemonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The daemon's configuration: one key per field, each with the comment above it
    saying what it means (``configdoc`` turns them into the configuration reference
    and the example file)."""

    # instance name: the region is /dev/shm/kvoffload-<instance>@<random>, its name
    # recorded in state_dir; one daemon per instance and state directory
    instance: str = "default"
    # unix socket to listen on; empty: $XDG_RUNTIME_DIR/kvoffload/kvoffloadd.sock, or
    # /tmp/kvoffload-$UID/kvoffloadd.sock (other instances: kvoffloadd-<instance>.sock)
    socket: str = ""
    # size of the shared region (bytes, or with a unit: "512MiB", "64GiB")
    region_size: int | str = "1GiB"
    # size of one extent, the unit in which memory moves between namespaces; 0: about
    # 64 extents per region, a power of two between 2 MiB and 256 MiB; must hold one block
    extent_size: int | str = 0
    # smallest slot; also sets the size of the slot table (96 bytes per possible slot)
    min_slot_size: int | str = "16KiB"
    # eviction policy inside a namespace: "lru" or "arc"
    policy: str = "lru"
    # CPU copier threads (1..64)
    copy_threads: int = 2
    # SCHED_BATCH (sched(7)): a write that wakes the daemon never preempts the engine that made it
    sched_batch: bool = True
    # log level: debug, info, warning or error
    log_level: str = "info"
    # largest protocol frame accepted from a client, in bytes (at least 4096)
    max_frame_bytes: int = 16 * 1024 * 1024
    # connections beyond this are closed at once
    max_clients: int = 1024
    # namespaces one uid may create (root and the daemon's uid are not limited; 0: no
    # limit); the table holds 256, and when it is full idle namespaces make room
    max_namespaces_per_uid: int = 32
    # blocks one client may have in flight in a namespace (being written, or leased to
    # it empty), as a share of the namespace's largest size; all clients together 1.5
    # times that, so a client never completing its stores cannot take the pool; 1: no
    # limit
    max_writing_fraction: float = 0.5
    # bytes of requests not yet complete and of replies not yet sent, all clients
    # together; beyond it the client holding the most is disconnected (each client may
    # also hold at most 32 MiB of unread replies and park at most 256 descriptors)
    buffer_budget: int | str = "256MiB"
    # pre-fault the region in the background after start-up
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
    # GPU copies for engines that register CUDA caches: "auto" uses the CUDA driver
    # (libcuda.so.1) and every GPU it sees when there are any; "off" refuses GPU workers
    gpu: str = "auto"
    # page-lock the region for GPU DMA (cuMemHostRegister, chunk by chunk as each is
    # populated, in the background); unpinned parts are copied more slowly
    pin_region: bool = True
    # small GPU copy runs (pages of a few KiB, canonical fragments) through the gather
    # kernel the package ships as PTX: "auto" where a start-up calibration on each GPU
    # finds it faster than DMA, "always" for every 16-byte aligned run, "off" (DMA only)
    gpu_kernel: str = "auto"
    # warm restart: a clean stop leaves the region (and every completed block in it) for
    # the next daemon of this instance, which recovers it; a crash always leaves it; the
    # systemd unit sets it (--keep-region), so upgrades and restarts keep the cache
    keep_region: bool = False
    # where the daemon records which segment in /dev/shm is its region (a name with a
    # random part no other uid can take first): a directory only the daemon's uid or
    # root may write, living as long as the region; empty: the socket's directory (under
    # the unit /run/kvoffloadd, kept across restarts until a reboot clears it)
    state_dir: str = ""
    # at start, drop this instance's region if it was made with another region_size,
    # extent_size, min_slot_size or format, instead of refusing to start (its blocks are
    # lost); a damaged region is always dropped, one another uid planted is ignored
    discard_region: bool = False
    # Prometheus endpoint port, serving /metrics, /healthz (the loop turns) and /readyz
    # (serving, region pre-faulted, GPU pinning done or failed); 0: no endpoint
    metrics_port: int = 0
    # the address the Prometheus endpoint listens on
    metrics_address: str = "127.0.0.1"
    # label the per-namespace series with namespace names; any local user can read the
    # metrics port, and a name tells whose model it is; off, they are summed as "all"
    metrics_namespace_labels: bool = False
    # uids allowed to evict and to read this configuration over the socket (reading
    # stats and the client list is open to every client); unset: root and the daemon's
    # own uid
    # example: [0, 998]
    admin_uids: list[int] | None = None
    # groups whose members may administer too (primary or supplementary gid)
    admin_gids: list[int] = msgspec.field(default_factory=list)
    # uids that may connect; with allow_uids and allow_gids both unset, whoever can
    # reach the socket may (it is 0660 in a 0750 directory: the daemon's user and
    # group); with either set, a peer needs a listed uid or group; root and the daemon's
    # own uid always may; identities come from the kernel (SO_PEERCRED, /proc)
    # example: [1000, 1001]
    allow_uids: list[int] | None = None
    # groups whose members may connect (primary or supplementary gid); see allow_uids
    # example: [997]
    allow_gids: list[int] | None = None
    # which peers may open which namespaces: rules are tried in order, the first whose
    # glob pattern matches the namespace name decides, and a name no rule matches is
    # refused; no rules: every peer may open every namespace
    namespace_access: list[NamespaceRule] = msgspec.field(default_factory=list)
    # quotas per namespace, the first matching pattern applies
    namespace_quotas: list[NamespaceQuota] = msgspec.field(default_factory=list)
    # what peers may make the daemon hold, per ledger line ([limits.<line>] tables of
    # per_connection, per_uid and total; docs/security.md lists every line and its
    # default); a request past a limit is QUOTA_EXCEEDED naming the line
    # example: {pins = {per_connection = 131072}, connections = {per_uid = 256}}
    limits: dict[str, LineLimits] = msgspec.field(default_factory=dict)
    # older key: copy jobs one connection may have in flight (a uid 4 times as many,
    # everyone 16 times); 0: limits.jobs decides
    max_inflight_jobs_per_client: int = 0
    # older key: pins one connection may hold (a uid 4 times as many, everyone 16
    # times); 0: limits.pins decides
    max_pins_per_client: int = 0
    # keep a CRC32 of every stored block (per rank) and verify it before each load: a
    # block whose bytes changed fails the load (the engine recomputes) and is evicted;
    # costs one extra pass over the block's bytes per store and per load
    verify_checksums: bool = False
    # while engines' key mirrors are attached, an evicted block stays loadable (its slot
    # is not reused) until they have all seen the eviction, or at most this long: a
    # lookup hit never turns into a failed load (graves.py)
    mirror_grace_s: float = 1.0
    # engines commit their stores one-way, sometimes before every rank's copy has
    # landed; such a store waits for its copies this long, then is dropped (never made
    # visible)
    commit_timeout_s: float = 30.0
    # a pin (prepare_load, or a load an engine planned) held longer is dropped: a load
    # takes a step, so nobody keeps a block, or the extent it lies in, for good
    pin_timeout_s: float = 60.0
    # empty slots leased to an engine that has claimed none of them for this long are
    # taken back (the engine is told and wishes again when it stores)
    lease_timeout_s: float = 30.0
    # uids that may map the region for client-copy workers (engines whose caches cannot
    # be exported copy their leased slots themselves, and so can read and write every
    # block of every namespace); unset: root and the daemon's own uid
    # example: [1000]
    client_copy_uids: list[int] | None = None
    # groups whose members may map the region for client-copy workers
    client_copy_gids: list[int] = msgspec.field(default_factory=list)
    # secondary tiers below the region, fastest first: every block stored in the region
    # is copied down to each tier that lacks it, in the background; a lookup that misses
    # the region but hits a tier promotes the block back and answers "ask again" (vLLM:
    # RETRY) until it is readable; each tier has its own capacity and eviction
    tiers: list[TierConfig] = msgspec.field(default_factory=list)
    # blocks per tier that may be pinned in the region while the tier copies them down;
    # more wait in a queue (and are skipped if the region evicts them first)
    tier_max_inflight_blocks: int = 256
    # threads of each tier that copy promoted blocks into the region and verify their
    # MACs, a promotion's blocks spread over them (a disk tier's read its files); 0: one
    # per CPU the daemon may run on (its CPU affinity), at most 64
    tier_threads: int = 0
    # a tier with a job running longer than this (a hung disk, a stuck server) is
    # stalled: its keys miss and it gets no new work until its late jobs finish
    tier_job_timeout_s: float = 30.0
    # the per-deployment secret that seals tier blocks with a keyed MAC: a file of 64
    # hex digits readable by kvoffloadd's user only (0600), generated at the first start
    # with tiers when absent; daemons sharing a tier need the same file; empty:
    # tier-secret in $STATE_DIRECTORY (the unit's /var/lib/kvoffload)
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
    def tier_thread_count(self) -> int:
        """``tier_threads``, or the CPUs this process may run on (at most 64)."""
        return self.tier_threads or min(len(os.sched_getaffinity(0)), 64)

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
        if self.gpu_kernel not in ("auto", "always", "off"):
            raise ConfigError(f"gpu_kernel: {self.gpu_kernel!r} is not one of auto, always, off")
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
        self.limit_overrides()  # names and sizes, for the error message
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
        if not 0 <= self.tier_threads <= 64:
            raise ConfigError(
                f"tier_threads: {self.tier_threads} is not in 0..64 (0: one per CPU the "
                "daemon may run on)"
            )
        if self.tier_max_inflight_blocks < 1:
            raise ConfigError(
                f"tier_max_inflight_blocks: {self.tier_max_inflight_blocks} is below 1"
            )
        if not 0 < self.max_writing_fraction <= 1:
            raise ConfigError(f"max_writing_fraction: {self.max_writing_fraction} is not in (0, 1]")
        if not 1 <= self.pin_timeout_s <= 3600:
            raise ConfigError(f"pin_timeout_s: {self.pin_timeout_s} is not in [1, 3600]")
        if not 1 <= self.lease_timeout_s <= 3600:
            raise ConfigError(f"lease_timeout_s: {self.lease_timeout_s} is not in [1, 3600]")
        if not 0 < self.commit_timeout_s <= 3600:
            raise ConfigError(f"commit_timeout_s: {self.commit_timeout_s} is not in (0, 3600]")
        if not 0 <= self.mirror_grace_s <= 60:
            raise ConfigError(f"mirror_grace_s: {self.mirror_grace_s} is not in 0..60")
        return self

    def limit_overrides(self) -> dict[str, dict[str, int]]:
        """The ledger limits this configuration sets (``limits``, and the older
        per-connection keys for pins and jobs, which scale 4x per uid, 16x in total)."""
        out: dict[str, dict[str, int]] = {}
        for name, lim in self.limits.items():
            if name not in SPECS:
                raise ConfigError(
                    f"limits.{name}: no such ledger line; one of {', '.join(sorted(SPECS))}"
                )
            out[name] = lim.resolved(f"limits.{name}")
        older = (("pins", "max_pins_per_client"), ("jobs", "max_inflight_jobs_per_client"))
        for name, key in older:
            n = getattr(self, key)
            if n and name not in out:
                out[name] = {"per_connection": n, "per_uid": 4 * n, "total": 16 * n}
        return out

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
