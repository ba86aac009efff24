"""``kvoffloadd`` command line: parse flags, build the region, serve until signalled."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import platform
import socket
import sys
from typing import Any

from kvoffload.datapath import memruns
from kvoffloadd import __version__
from kvoffloadd.config import DEFAULT_CONFIG_PATH, ConfigError, DaemonConfig, load_config
from kvoffloadd.copies.copier import CpuCopier
from kvoffloadd.copies.gpu import start_gpu
from kvoffloadd.index import keyset, policies
from kvoffloadd.region import journal
from kvoffloadd.region.backing import HUGE_PAGES
from kvoffloadd.region.bringup import RegionSetup, fit_check, plan_setup
from kvoffloadd.region.region import RegionError, SharedOffloadRegion
from kvoffloadd.region.regionstate import RegionState, open_region
from kvoffloadd.server.listener import bind_listener
from kvoffloadd.server.logfmt import setup_logging, written_off_the_loop
from kvoffloadd.server.metrics import MetricsEndpoint
from kvoffloadd.server.server import Server
from kvoffloadd.server.systemd import Notifier, listen_fds
from kvoffloadd.service.service import Service
from kvoffloadd.tiers import BlockMac, SecondaryTier, TierError, WakeFd, build_tier, read_secret
from kvoffloadd.tiers.tiering import Tiering
from kvoffloadd.trust import FileLock, UntrustedError, raise_fd_limit, secure_dir

log = logging.getLogger("kvoffloadd")


def yield_to_engines() -> None:
    """Run every thread as SCHED_BATCH (those started later inherit it): an engine's
    one-way write wakes the loop without the kernel preempting the engine for it (a
    batch thread preempts nobody on wake-up). On a machine with an idle CPU the loop
    runs there at once; on a busy one, at the next scheduler tick, instead of taking
    the CPU of the engine that wrote and leaving it behind every other runnable task."""
    for tid in os.listdir("/proc/self/task"):  # the loop, and threads imports started
        try:
            os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            continue  # it ended meanwhile
        except OSError as exc:
            log.warning(
                "cannot run as SCHED_BATCH (%s): an engine's write to the daemon may wait "
                "for the daemon's turn; set sched_batch = false to silence this",
                exc,
            )
            return


def note_python_paths() -> None:
    """Say which C paths do not run here: their Python stand-ins are correct, and
    slower. Not built (no C compiler at install) is a warning; turned off on purpose
    (for a comparison) is said at info level."""
    for what, built, used, env, cost in (
        ("C copy loop", memruns.BUILT, memruns.NATIVE, "KVOFFLOAD_NO_NATIVE_COPY",
         "CPU copies of small pages run at about half of memcpy"),
        ("C key set", keyset.BUILT, keyset.NATIVE, "KVOFFLOAD_NO_NATIVE_INDEX",
         "lookups make a Python object per key, several times slower"),
        ("C Block", policies.BUILT, policies.NATIVE, "KVOFFLOAD_NO_NATIVE_INDEX",
         "each block a store makes is a Python object built by a Python __init__"),
        ("C slot record writer", journal.BUILT, journal.NATIVE, "KVOFFLOAD_NO_NATIVE_JOURNAL",
         "each slot record a store writes costs a struct pack and a mapping write"),
    ):  # fmt: skip
        if not built:
            log.warning("the %s is not built (install with a C compiler): %s", what, cost)
        elif not used:
            log.info("the %s is turned off (%s): %s", what, env, cost)


def parser() -> argparse.ArgumentParser:
    """The command line; every flag but ``--config`` overrides the config key of its
    name (docs/configuration.md lists them)."""
    p = argparse.ArgumentParser(
        prog="kvoffloadd", description="Node-local KV-cache offload daemon."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML config file (default: {DEFAULT_CONFIG_PATH} if it exists)",
    )
    p.add_argument("--socket", metavar="PATH", help="unix socket path to listen on")
    p.add_argument(
        "--instance", metavar="NAME", help="instance name (region and socket names derive from it)"
    )
    p.add_argument(
        "--region-size", dest="region_size", metavar="SIZE", help="region size, e.g. 1GiB"
    )
    p.add_argument(
        "--extent-size", dest="extent_size", metavar="SIZE", help="extent size, e.g. 16MiB"
    )
    p.add_argument("--policy", metavar="POLICY", help="eviction policy: lru or arc")
    p.add_argument(
        "--copy-threads", dest="copy_threads", type=int, metavar="N", help="CPU copier threads"
    )
    p.add_argument(
        "--log-level", dest="log_level", metavar="LEVEL", help="debug, info, warning or error"
    )
    p.add_argument(
        "--metrics-port",
        dest="metrics_port",
        type=int,
        metavar="PORT",
        help="Prometheus port (0: off)",
    )
    p.add_argument(
        "--keep-region",
        dest="keep_region",
        action="store_true",
        default=None,
        help="leave the region for the next daemon on a clean stop (warm restart)",
    )
    p.add_argument(
        "--discard-region",
        dest="discard_region",
        action="store_true",
        default=None,
        help="drop an existing region that cannot be recovered instead of refusing to start",
    )
    p.add_argument("--gpu", choices=("auto", "off"), help="GPU copies for CUDA engines")
    p.add_argument(
        "--no-pin",
        dest="pin_region",
        action="store_false",
        default=None,
        help="do not page-lock the region for GPU copies",
    )
    p.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_false",
        default=None,
        help="do not pre-fault the region in the background",
    )
    p.add_argument(
        "--populate-threads",
        dest="populate_threads",
        type=int,
        help="threads populating the region (0: one per usable CPU)",
    )
    p.add_argument("--numa", choices=("auto", "off"), help="place the region by NUMA node")
    p.add_argument(
        "--huge-pages", dest="huge_pages", choices=HUGE_PAGES, help="huge pages for the region"
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def config_of(args: argparse.Namespace) -> DaemonConfig:
    """Defaults, then the config file, then the flags."""
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "config"}
    return load_config(args.config, overrides)


def activated_listener() -> socket.socket | None:
    """The unix stream socket systemd passed (socket activation), if any."""
    for sock, _name in listen_fds():
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            return sock
        sock.close()
    return None


def build(
    cfg: DaemonConfig, listener: socket.socket | None, notifier: Notifier
) -> tuple[FileLock, RegionState, SharedOffloadRegion, CpuCopier, Server]:
    """Lock the socket path and the region's record, adopt the recorded region or make
    one, bind (unless activated) and wire the loop. Nothing found on the way is trusted
    (trust.py, regionstate.py)."""
    if listener is not None:
        cfg.socket = listener.getsockname() or cfg.socket_path
    secure_dir(os.path.dirname(os.path.abspath(cfg.socket_path)))
    secure_dir(cfg.state_path, 0o700)
    lock = FileLock(f"{cfg.socket_path}.lock", f"pid {os.getpid()} instance {cfg.instance}\n")
    state = None
    try:
        state = RegionState(cfg.state_path, cfg.instance)
        setup = region_setup(cfg)
        check = fit_check(setup, cfg.memory_headroom_bytes) if cfg.check_memory_limits else None
        region = open_region(
            state,
            setup.geometry,
            discard=cfg.discard_region,
            backing=setup.backing,
            before_map=check,
            plan=setup.plan,
            topology=setup.topology,
        )
    except BaseException:
        if state is not None:
            state.release(forget=False)
        lock.release()
        raise
    describe_setup(setup)
    if cfg.prefault:
        region.prepare_populate(huge_advise=cfg.huge_pages == "thp")
        if not region.recovered:
            region.start_populate()
    copier = CpuCopier(cfg.copy_threads)
    gpu, gpu_unavailable = start_gpu(cfg, region, copier.sink)
    if gpu is None:
        log.info("GPU copies off: %s", gpu_unavailable)
    metrics = tiering = None
    try:
        tiering = build_tiering(cfg, region)
        if listener is None:
            listener = bind_listener(cfg.socket_path)
        if cfg.metrics_port:
            metrics = MetricsEndpoint(
                cfg.metrics_address, cfg.metrics_port, cfg.metrics_namespace_labels
            )
    except BaseException:
        if tiering is not None:
            tiering.close()
        if gpu is not None:
            gpu.close()
        copier.close()
        region.close(unlink=not cfg.keep_region)
        state.release(forget=not cfg.keep_region)
        lock.release()
        raise
    service = Service(cfg, region, copier, gpu, gpu_unavailable, tiering)
    if cfg.prefault and region.recovered:
        # a kept region is resident: mapping it again waits until its blocks are
        # recovered (Service), so as not to slow the start on a machine of few CPUs;
        # a pinner started meanwhile waits for the mapping
        region.start_populate()
    server = Server(service, listener, notifier, metrics)
    return lock, state, region, copier, server


def region_setup(cfg: DaemonConfig) -> RegionSetup:
    return plan_setup(
        cfg.region_bytes,
        cfg.extent_bytes,
        cfg.min_slot_bytes,
        huge_pages=cfg.huge_pages,
        region_dir=cfg.region_dir,
        numa=cfg.numa,
        populate_threads=cfg.populate_threads,
        chunk_bytes=cfg.populate_chunk_bytes,
    )


def describe_setup(setup: RegionSetup) -> None:
    plan, b = setup.plan, setup.backing
    parts = ", ".join(
        f"{'all nodes' if p.node is None else f'node {p.node}'}: {n / 2**30:.1f} GiB, "
        f"{p.gpus} GPUs, {t} threads"
        for p, n, t in zip(plan.parts, plan.part_bytes, plan.threads)
    )
    log.info(
        "region in %s (%s, huge_pages %s%s): %d chunks of at most %d MiB; numa %s (%s)",
        b.directory,
        b.fstype,
        b.huge_pages,
        f", {b.how}" if b.how else "",
        len(plan.chunks),
        plan.chunk_bytes >> 20,
        plan.numa,
        parts,
    )


def build_tiering(cfg: DaemonConfig, region: SharedOffloadRegion) -> Tiering | None:
    """The configured secondary tiers. One that cannot start (a directory that cannot
    be written) stops the daemon's start with ``ConfigError``; an unreachable Redis does
    not: it is only unhealthy until it answers."""
    if not cfg.tiers:
        return None
    try:
        mac = BlockMac(read_secret(cfg.tier_secret_path))
    except TierError as exc:
        raise ConfigError(str(exc)) from exc
    log.info("tier blocks sealed with key id %s (%s)", mac.key_id.hex(), cfg.tier_secret_path)
    wake = WakeFd()
    tiers: list[SecondaryTier] = []
    for tc in cfg.tiers:
        try:
            tiers.append(build_tier(tc, wake, mac, cfg.tier_thread_count))
        except TierError as exc:
            for t in tiers:
                t.close()
            wake.close()
            raise ConfigError(str(exc)) from exc
        log.info("secondary tier %s (%s) below the region", tc.name, tc.type)
    return Tiering(
        tiers,
        wake,
        region.buffer,
        max_inflight_blocks=cfg.tier_max_inflight_blocks,
        job_timeout_s=cfg.tier_job_timeout_s,
    )


NT_THRESHOLD_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
# The least glibc takes (it ignores 0x4040 and below): copies past 16 KiB stream.
NT_THRESHOLD_BYTES = 0x4041


def reexec_with_copy_tunables() -> None:
    """Re-exec once so glibc's memmove streams KV pages past the cache.

    glibc switches memmove to non-temporal stores only above a threshold near the L3
    size, so copying KV blocks of 0.5-2 MiB one by one runs at about half the speed of
    one huge memcpy (measured: 7.8 vs 15 GB/s for 2 MiB pieces), and pages of 20-32 KiB
    (a cache per layer) copy through ``rep movsb`` at 5.3 GB/s where they stream at 6.9
    (2 vCPUs, one thread; one 128 MiB memcpy: 8-9). The threshold is a glibc tunable
    read at process start, hence the re-exec. Opt out with KVOFFLOAD_NO_REEXEC=1.
    """
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if NT_THRESHOLD_TUNABLE in tunables or os.environ.get("KVOFFLOAD_NO_REEXEC"):
        return
    if platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return
    setting = f"{NT_THRESHOLD_TUNABLE}={NT_THRESHOLD_BYTES:#x}"
    env = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{setting}" if tunables else setting)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvoffloadd", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if argv is None:
        reexec_with_copy_tunables()
    try:
        cfg = config_of(args)
    except ConfigError as exc:
        print(f"kvoffloadd: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    note_python_paths()
    if cfg.sched_batch:
        yield_to_engines()
    fd_limit = raise_fd_limit()
    log.debug("descriptor limit %d", fd_limit)
    notifier = Notifier()
    activated = activated_listener()
    try:
        lock, state, region, copier, server = build(cfg, activated, notifier)
    except (RegionError, ConfigError, UntrustedError, OSError) as exc:
        log.error("cannot start: %s", exc)
        notifier.notify(STATUS=f"cannot start: {exc}")
        return 1
    server.catch_signals()
    g = region.geometry
    if region.recovered:
        blocks = sum(ns.slots.num_extents for ns in server.service.namespaces.values())
        log.info(
            "warm restart: recovered %d namespaces over %d extents",
            len(server.service.namespaces),
            blocks,
        )
    print(
        f"kvoffloadd {cfg.instance}: listening on {cfg.socket_path}; region {region.name} "
        f"{g.region_bytes / 2**30:.2f} GiB in {g.num_extents} extents of "
        f"{g.extent_bytes >> 20} MiB; policy {cfg.policy}",
        flush=True,
    )
    # Everything built so far lives as long as the daemon: out of the collector's sight,
    # a full collection no longer walks ~32,000 start-up objects, a 10 ms pause of the
    # loop (and of every thread that needs the GIL) measured as 0.2 ms after.
    gc.freeze()
    server.service.loop.frozen_objects = gc.get_freeze_count()
    notifier.notify(READY=1, STATUS="serving; pre-faulting region", MAINPID=os.getpid())
    try:
        with written_off_the_loop():  # the loop never waits on its log's reader
            server.serve_forever()
    finally:
        if server.metrics is not None:
            server.metrics.close()
        if server.service.gpu is not None:
            server.service.gpu.close()
        if server.service.tiering is not None:
            server.service.tiering.close()
        copier.close()
        if server.service.transfers.fd_copier is not None:  # done before the region goes
            server.service.transfers.fd_copier.close()
        region.close(unlink=not cfg.keep_region)
        state.release(forget=not cfg.keep_region)
        server.listener.close()
        if activated is None:  # an activated socket belongs to systemd
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.socket_path)
        lock.release()
        notifier.close()
    log.info("stopped cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
