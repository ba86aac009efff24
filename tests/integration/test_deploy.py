"""deploy/: the Kubernetes manifests are valid against the Kubernetes schemas (offline),
agree with each other and with the daemon's config keys; the Grafana dashboard asks
only for series a live daemon exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_probes import PROBE_TIMEOUT_S

import kvoffload
from kvoffloadbench.launch import DaemonProcess
from kvoffloadbench.server_process import free_port
from kvoffloadd.config import DaemonConfig, load_config

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "kubernetes"
GIB = 1 << 30


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def kind(docs: list[dict[str, Any]], k: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == k]
    return doc


def quantity_bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    found = re.fullmatch(r"(\d+)([KMGT]i)?", q)
    assert found is not None, q
    num, unit = found.groups()
    return int(num) * units.get(unit or "", 1)


@pytest.mark.parametrize(
    "name", ["kvoffloadd.yaml", "kvoffloadd-hugepages.yaml", "vllm-example.yaml"]
)
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    version = kubernetes_validate.latest_version()
    for doc in documents(name):
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_a_wrong_field_is_caught_by_the_validation() -> None:
    ds = kind(documents("kvoffloadd.yaml"), "DaemonSet")
    ds["spec"]["template"]["spec"]["hostIpc"] = True  # a typo of hostIPC
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, kubernetes_validate.latest_version(), strict=True)


def test_the_daemonset_and_its_config_agree(tmp_path: Path) -> None:
    docs = documents("kvoffloadd.yaml")
    cm, ds = kind(docs, "ConfigMap"), kind(docs, "DaemonSet")
    toml = tmp_path / "kvoffloadd.toml"
    toml.write_text(cm["data"]["kvoffloadd.toml"])
    cfg = load_config(str(toml), {})  # every key is a real one (unknown keys refuse)
    assert cfg.keep_region and cfg.metrics_address == "0.0.0.0"
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert spec["hostIPC"] is True
    assert c["args"] == ["--config", "/etc/kvoffload/kvoffloadd.toml"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["config"] == "/etc/kvoffload"
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert Path(cfg.socket_path).parent == Path(mounts["socket-dir"])
    assert volumes["socket-dir"]["hostPath"]["path"] == mounts["socket-dir"]
    assert mounts["dshm"] == volumes["dshm"]["hostPath"]["path"] == "/dev/shm"
    # the region's record outlives the pod (a host path) and is the daemon's alone
    state = [n for n, path in mounts.items() if path == cfg.state_dir]
    assert state and volumes[state[0]]["hostPath"]["path"] == cfg.state_dir
    engines = kind(documents("vllm-example.yaml"), "Deployment")["spec"]["template"]["spec"]
    assert all(v.get("hostPath", {}).get("path") != cfg.state_dir for v in engines["volumes"])
    (port,) = c["ports"]
    assert port["containerPort"] == cfg.metrics_port
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.metrics_port)
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz")):
        assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # the probe test_probes.py proves unstarvable, which a watchdog's 30 s allow
        assert c[probe]["timeoutSeconds"] == PROBE_TIMEOUT_S
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    # the region's pages are charged to the pod: the daemon refuses to start in less
    assert quantity_bytes(limits["memory"]) >= cfg.region_bytes + cfg.memory_headroom_bytes
    assert requests["memory"] == limits["memory"]  # Guaranteed: nothing to reclaim
    assert "cpu" not in limits  # a CPU quota would cap the populate threads
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]  # pinning


def test_the_hugepages_variant_differs_only_in_the_region_pages(tmp_path: Path) -> None:
    """kvoffloadd-hugepages.yaml: the same DaemonSet, its region in 2 MiB pages on the
    node's hugetlbfs mount (kept across pod restarts), hugepages-2Mi sized from the
    region, the memory limit from the headroom alone."""
    plain, huge = documents("kvoffloadd.yaml"), documents("kvoffloadd-hugepages.yaml")
    toml = tmp_path / "kvoffloadd.toml"
    toml.write_text(kind(huge, "ConfigMap")["data"]["kvoffloadd.toml"])
    cfg = load_config(str(toml), {})
    assert cfg.huge_pages == "2M" and cfg.page_bytes == 2 << 20
    pod = kind(huge, "DaemonSet")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits["hugepages-2Mi"] == requests["hugepages-2Mi"]  # no overcommit
    assert quantity_bytes(limits["hugepages-2Mi"]) >= cfg.region_bytes
    assert quantity_bytes(limits["memory"]) >= cfg.memory_headroom_bytes
    assert quantity_bytes(limits["memory"]) < cfg.region_bytes  # huge pages are not in it
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (region_vol,) = [n for n, path in mounts.items() if path == cfg.region_dir]
    assert volumes[region_vol]["hostPath"] == {"path": cfg.region_dir, "type": "Directory"}
    # everything else is kvoffloadd.yaml's
    ds_plain, ds_huge = kind(plain, "DaemonSet"), kind(huge, "DaemonSet")
    for ds in (ds_plain, ds_huge):
        spec = ds["spec"]["template"]["spec"]
        (cc,) = spec["containers"]
        del cc["resources"]
        cc["volumeMounts"] = [m for m in cc["volumeMounts"] if m["name"] != region_vol]
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != region_vol]
    assert ds_plain == ds_huge
    cm_plain = load_config_text(tmp_path, kind(plain, "ConfigMap")["data"]["kvoffloadd.toml"])
    for key in ("huge_pages", "region_dir"):
        setattr(cfg, key, getattr(cm_plain, key))
    assert cfg == cm_plain


def load_config_text(tmp_path: Path, text: str) -> DaemonConfig:
    f = tmp_path / "other.toml"
    f.write_text(text)
    return load_config(str(f), {})


def test_the_vllm_example_reaches_the_daemon_of_its_node() -> None:
    cm = kind(documents("kvoffloadd.yaml"), "ConfigMap")
    found = re.search(r'socket = "([^"]+)"', cm["data"]["kvoffloadd.toml"])
    assert found is not None, cm["data"]["kvoffloadd.toml"]
    socket_path = found.group(1)
    dep = kind(documents("vllm-example.yaml"), "Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["hostIPC"] is True
    kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "OffloadingConnector"
    extra = kv["kv_connector_extra_config"]
    assert extra["spec_name"] == "KVOffloadSpec" and extra["socket_path"] == socket_path
    spec_module = ROOT / "libclient" / Path(*extra["spec_module_path"].split("."))
    assert "KVOffloadSpec" in (spec_module / "__init__.py").read_text()
    assert {"name": "KVOFFLOAD_SOCKET", "value": socket_path} in c["env"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    assert mounts["socket-dir"] == volumes["socket-dir"] == str(Path(socket_path).parent)
    assert mounts["dshm"] == volumes["dshm"] == "/dev/shm"


def exported_series(tmp_path: Path) -> dict[str, set[str]]:
    """Series name -> label names, scraped from a daemon with a disk tier."""
    cfg = tmp_path / "k.toml"
    cfg.write_text(
        f'tier_secret_file = "{tmp_path / "tier-secret"}"\n'
        f'[[tiers]]\ntype = "disk"\npath = "{tmp_path / "disk"}"\ncapacity = "8MiB"\n'
    )
    port = free_port()
    with DaemonProcess("64MiB", "--config", str(cfg), "--metrics-port", str(port)) as d:
        with kvoffload.connect(d.socket_path) as c:
            c.namespace("n", kvoffload.KVLayout([4096])).lookup([b"k" * 8])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := re.match(r"(kvoffload_\w+)(?:\{(.*)\})? ", line):
            labels = set(re.findall(r"(\w+)=", m.group(2) or ""))
            series.setdefault(m.group(1), set()).update(labels)
    return series


def test_the_dashboard_asks_only_for_series_the_daemon_exports(tmp_path: Path) -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvoffload.json").read_text())
    series = exported_series(tmp_path)
    assert "kvoffload_tier_healthy" in series and "kvoffload_errors_total" in series
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    wanted = {
        "hit rate", "occupancy", "evict", "throughput", "tier health", "promotions",
        "errors", "clients",
    }  # fmt: skip
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    assert all(w in titles for w in wanted), titles
    for expr in exprs:
        names = re.findall(r"\bkvoffload_\w+", expr)
        assert names, expr
        for name in names:
            assert name in series, f"{name} is not exported ({expr})"
        for group in re.findall(r"by \(([^)]*)\)", expr):  # labels it groups by exist
            for label in (x.strip() for x in group.split(",")):
                assert label == "instance" or any(label in series[n] for n in names), (
                    label,
                    expr,
                )


def test_every_node_reads_the_same_tier_secret_as_one_plain_file() -> None:
    """The config's tier_secret_file is the Secret mounted by subPath (a bind-mounted
    file, not the symlinks of a Secret volume, which the daemon refuses), root-only."""
    docs = documents("kvoffloadd.yaml")
    cm, ds = kind(docs, "ConfigMap"), kind(docs, "DaemonSet")
    cfg_text = cm["data"]["kvoffloadd.toml"]
    (line,) = [x for x in cfg_text.splitlines() if x.startswith("tier_secret_file")]
    path = line.split("=", 1)[1].strip().strip('"')
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
    assert mount["subPath"] == "tier-secret" and mount["readOnly"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"]["secretName"] == "kvoffloadd-tier-secret"
    assert vol["secret"]["defaultMode"] == 0o400
