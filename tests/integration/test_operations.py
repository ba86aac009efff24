"""Operations against a live daemon: systemd notify/activation/watchdog, metrics, admin."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import ctl, store_blocks

import kvoffload
from kvoffload.protocol import messages as m
from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]


def recv_states(mgr: socket.socket, want: str, deadline_s: float = 20.0) -> list[str]:
    got: list[str] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            got.append(mgr.recv(4096).decode())
        except TimeoutError:
            continue
        if any(want in g for g in got):
            return got
    raise AssertionError(f"no {want!r} from the daemon; got {got}")


def test_notify_socket_activation_watchdog_and_stopping(tmp_path: Path) -> None:
    """Type=notify, socket activation and the watchdog, against a fake service manager."""
    mgr = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mgr.bind(str(tmp_path / "notify"))
    mgr.settimeout(0.5)
    sock_path = str(tmp_path / "run" / "kvoffloadd.sock")
    os.makedirs(os.path.dirname(sock_path))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    fd = listener.fileno()
    instance = f"sd{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="300000", FD=str(fd)
    )
    # Stand in for systemd: put the socket at fd 3, name this pid, exec the daemon.
    launcher = (
        "import os, sys; os.dup2(int(os.environ['FD']), 3); pid = str(os.getpid());"
        "os.environ.update(LISTEN_PID=pid, LISTEN_FDS='1', LISTEN_FDNAMES='kvoffload',"
        " WATCHDOG_PID=pid); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            launcher,
            "-m",
            "kvoffloadd",
            "--instance",
            instance,
            "--region-size",
            "32MiB",
            "--log-level",
            "warning",
        ],
        env=env,
        pass_fds=(fd,),
        stdout=subprocess.DEVNULL,
    )
    listener.close()  # the daemon owns it now
    try:
        states = recv_states(mgr, "READY=1")
        ready = next(s for s in states if "READY=1" in s)
        assert f"MAINPID={proc.pid}" in ready and "STATUS=" in ready
        c = kvoffload.connect(sock_path)  # served on the activated socket
        assert c.ping() < 5
        c.close()
        recv_states(mgr, "WATCHDOG=1")
        proc.terminate()
        recv_states(mgr, "STOPPING=1")
        assert proc.wait(30) == 0
        assert os.path.exists(sock_path), "an activated socket belongs to systemd"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mgr.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    for name in ("kvoffloadd.service", "kvoffloadd.socket"):
        text = (ROOT / "systemd" / name).read_text()
        exe = shutil.which("kvoffloadd") or os.path.join(
            os.path.dirname(sys.executable), "kvoffloadd"
        )
        (tmp_path / name).write_text(text.replace("/usr/local/bin/kvoffloadd", exe))
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "kvoffloadd.socket", "kvoffloadd.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_prometheus_endpoint_scrapes_live_counters_and_hides_namespace_names() -> None:
    port = free_port()
    with DaemonProcess("64MiB", "--log-level", "warning", "--metrics-port", str(port)) as d:
        status, first = scrape(port)  # every series, with its value, from the first scrape
        assert status == 200 and "kvoffload_region_bytes 6" in first
        assert "kvoffload_clients 0.0" in first and 'namespace="all"' in first
        assert 'kvoffload_errors_total{code="NO_SPACE"} 0.0' in first  # every code, at 0
        c = kvoffload.connect(d.socket_path)
        keys = [b"m%07d" % i for i in range(4)]
        ns, _ = store_blocks(c, "llama-hidden-project", keys)
        ns.lookup([*keys, b"missing!"])
        body = ""
        end = time.monotonic() + 20
        while 'kvoffload_hit_keys_total{namespace="all"} 4.0' not in body:
            assert time.monotonic() < end, body[-2000:]
            time.sleep(0.2)
            body = scrape(port)[1]
        assert 'kvoffload_lookup_keys_total{namespace="all"} 5.0' in body
        assert 'kvoffload_copied_bytes_total{direction="store"} 16384.0' in body
        assert 'kvoffload_blocks{namespace="all",state="stored"} 4.0' in body
        assert "kvoffload_region_bytes " in body and "kvoffload_clients 1.0" in body
        assert "# TYPE kvoffload_copy_throughput_bytes_per_second gauge" in body
        assert "hidden-project" not in body  # any local user can read this port
        status, health = scrape(port, "/healthz")
        assert status == 200 and json.loads(health)["alive"]
        status, ready = scrape(port, "/readyz")
        assert status == 200 and json.loads(ready)["ready"] and not json.loads(ready)["pending"]
        assert scrape(port, "/nothing")[0] == 404
        c.close()


def test_namespace_names_label_the_series_when_configured(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "m.toml"
    cfg.write_text("metrics_namespace_labels = true\n")
    with DaemonProcess(
        "64MiB", "--config", str(cfg), "--metrics-port", str(port), "--log-level", "warning"
    ) as d:
        c = kvoffload.connect(d.socket_path)
        store_blocks(c, "llama", [b"m%07d" % i for i in range(2)])
        end = time.monotonic() + 20
        while 'kvoffload_blocks{namespace="llama",state="stored"} 2.0' not in scrape(port)[1]:
            assert time.monotonic() < end
            time.sleep(0.2)
        c.close()


def test_top_config_and_prefix_eviction(daemon: DaemonProcess) -> None:
    c = kvoffload.connect(daemon.socket_path)
    keys = [b"aa" + b"%06d" % i for i in range(3)] + [b"bb" + b"%06d" % i for i in range(3)]
    ns, _ = store_blocks(c, "llama", keys)

    r = ctl(daemon.socket_path, "--json", "top", "--interval", "0.2", "--count", "2")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and {"store_gbps", "hit_rate", "occupancy_ratio"} <= set(rows[0])
    r = ctl(daemon.socket_path, "top", "--interval", "0.1", "--count", "1")
    assert r.returncode == 0 and "HIT_RATE" in r.stdout

    cfg = json.loads(ctl(daemon.socket_path, "--json", "config").stdout)
    assert cfg["region_size"] == 64 << 20 and cfg["policy"] == "lru"
    assert cfg["socket"] == daemon.socket_path

    r = ctl(daemon.socket_path, "evict", "--namespace", "llama", "--prefix", b"aa".hex())
    assert "evicted 3 blocks" in r.stdout
    assert ns.lookup(keys[3:]) == 3 and ns.lookup(keys[:1]) == 0
    c.close()


def test_start_up_objects_are_out_of_the_collectors_sight(daemon: DaemonProcess) -> None:
    """gc.freeze() after start-up: a full collection would otherwise walk every module,
    class and function object and hold the GIL (the loop and the copiers) for ~10 ms."""
    c = kvoffload.connect(daemon.socket_path)
    assert c.stats()["loop"]["gc_frozen_objects"] > 10_000
    c.close()


def test_every_daemon_thread_yields_to_engines_unless_configured_not_to(
    daemon: DaemonProcess,
) -> None:
    """SCHED_BATCH on every thread (the loop, copiers, workers): an engine's write that
    wakes the daemon does not preempt the engine. ``sched_batch = false`` leaves them
    SCHED_OTHER."""
    kvoffload.connect(daemon.socket_path).close()
    tids = [int(t) for t in os.listdir(f"/proc/{daemon.pid}/task")]
    assert len(tids) > 1
    assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_BATCH}
    with DaemonProcess("32MiB", "--log-level", "error", settings={"sched_batch": False}) as d:
        tids = [int(t) for t in os.listdir(f"/proc/{d.pid}/task")]
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_OTHER}


def test_evict_and_config_refused_for_non_admin_uid(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(f"admin_uids = [{os.getuid() + 4242}]\n")
    with DaemonProcess("32MiB", "--config", str(cfg), "--log-level", "error") as d:
        r = ctl(d.socket_path, "evict")
        assert r.returncode == 3, r  # refused by the daemon
        assert "PERMISSION_DENIED" in r.stderr and "admin_uids" in r.stderr
        r = ctl(d.socket_path, "config")
        assert r.returncode == 3 and "PERMISSION_DENIED" in r.stderr
        r = ctl(d.socket_path, "--json", "stats")
        assert r.returncode == 0  # reading stats is open to every client
        assert json.loads(r.stdout)["errors"]["PERMISSION_DENIED"] == 2


def test_config_file_is_used_and_bad_keys_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text('policy = "arc"\nregion_size = "32MiB"\ncopy_threads = 1\n')
    with DaemonProcess("32MiB", "--config", str(cfg), "--log-level", "warning") as d:
        c = kvoffload.connect(d.socket_path)
        assert c.config()["policy"] == "arc" and c.config()["copy_threads"] == 1
        c.close()
    cfg.write_text("regoin_size = 5\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffloadd",
            "--config",
            str(cfg),
            "--socket",
            os.path.join(tempfile.mkdtemp(), "s.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "regoin_size" in r.stderr


def _connect_as(sock: str, uid: int, out: Any) -> None:
    """Child process: drop to ``uid`` (keeping gid 0 to reach the socket), connect."""
    os.setgroups([])
    os.setuid(uid)
    try:
        c = kvoffload.connect(sock, timeout_s=5)
        c.ping()
    except kvoffload.KVOffloadError as exc:
        out.put(f"{type(exc).__name__}: {exc}")
        return
    ns = c.namespace("cc-1", kvoffload.KVLayout(tensor_page_bytes=[4096]))
    desc = m.CacheDesc("client", 4, 4096)
    try:  # mapping the region (client-copy mode) is for client_copy_uids only
        c.call(
            lambda rid: m.AttachWorker(rid, ns.ns_id, 0, [desc], b"", b"", True),
            m.WorkerAttached,
        )
        out.put("connected; client copy allowed")
    except kvoffload.PermissionDeniedError as exc:
        out.put(f"connected; client copy refused: {exc}")
    except Exception as exc:  # anything else is reported, not hung on
        out.put(f"connected; {type(exc).__name__}: {exc}")
    c.close()


def test_peer_credentials_decide_who_connects_and_which_namespaces(tmp_path: Path) -> None:
    cfg = tmp_path / "k.toml"
    cfg.write_text(
        f'allow_uids = [4243]\n[[namespace_access]]\npattern = "ours-*"\nuids = [{os.getuid()}]\n'
        '[[namespace_access]]\npattern = "cc-*"\nuids = [4243]\n'
    )
    run = Path(tempfile.mkdtemp(prefix="kvoffload-acl-"))  # reachable by other uids
    run.chmod(0o755)
    sock = str(run / "k.sock")
    with DaemonProcess(
        "32MiB", "--config", str(cfg), "--log-level", "error", socket_path=sock
    ) as d:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        c = kvoffload.connect(d.socket_path)
        c.namespace("ours-1", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        with pytest.raises(kvoffload.PermissionDeniedError, match="namespace_access"):
            c.namespace("theirs", kvoffload.KVLayout(tensor_page_bytes=[4096]))
        if os.getuid() == 0 and os.getgid() == 0:  # only root can pose as other users
            ctx = mp.get_context("spawn")
            for uid, want in (
                (4242, "PermissionDeniedError"),
                (4243, "connected; client copy refused: [PERMISSION_DENIED] uid 4243 may not map"),
            ):
                q = ctx.Queue()
                p = ctx.Process(target=_connect_as, args=(d.socket_path, uid, q))
                p.start()
                got = q.get(timeout=60)
                p.join(60)
                assert got.startswith(want), got
        c.ping()  # the daemon is alive and serves us
        assert c.stats()["errors"]["PERMISSION_DENIED"] >= 1
        c.close()
    shutil.rmtree(run, ignore_errors=True)
