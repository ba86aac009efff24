"""The systemd units do what docs/operations.md says, with the config keys they rely on."""

from __future__ import annotations

import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

from kvoffloadd.config import DaemonConfig
from kvoffloadd.main import config_of, parse_args
from kvoffloadd.service.budgets import FD_RESERVE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[2]
UNITS = ROOT / "systemd"
OPERATIONS = ROOT / "docs" / "operations.md"  # how to install and run the units
TIERS = ROOT / "docs" / "tiers.md"  # its first toml block: the tiers example


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
            continue
        key, _, value = line.partition("=")
        assert section and _, f"{name}: not a key=value line: {line!r}"
        out[section][key.strip()].append(value.strip())
    return out


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key, [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def test_the_service_keeps_the_region_across_stops_and_removes_nothing() -> None:
    """docs/operations.md: a stop keeps the region for a warm restart (keep_region)."""
    svc = unit("kvoffloadd.service")["Service"]
    assert "ExecStopPost" not in svc and "ExecStop" not in svc
    assert "ExecStartPre" not in svc and one(svc, "RemoveIPC") == "no"
    argv = shlex.split(one(svc, "ExecStart"))
    assert argv[0].endswith("/kvoffloadd")
    args = parse_args(argv[1:])
    assert args.config == "/etc/kvoffload/kvoffloadd.toml"
    tmpfiles = (UNITS / "kvoffload.tmpfiles.conf").read_text()
    assert re.search(r"^d /etc/kvoffload ", tmpfiles, re.M), "the config directory exists"
    args.config = str(UNITS / "kvoffloadd.toml.example")  # what operations.md installs there
    cfg = config_of(args)
    assert cfg.keep_region and not cfg.discard_region
    # the region's record (which segment is the region) lives next to the activated
    # socket, in the runtime directory the unit keeps across stops, as the region is
    cfg.socket = one(unit("kvoffloadd.socket")["Socket"], "ListenStream")
    assert cfg.state_path == f"/run/{one(svc, 'RuntimeDirectory')}"
    assert one(svc, "RuntimeDirectoryPreserve") == "yes"
    assert int(one(svc, "RuntimeDirectoryMode"), 8) & 0o022 == 0  # the daemon's alone
    record = f"{cfg.state_path}/kvoffload-{cfg.instance}.region"
    operations = OPERATIONS.read_text()
    for text in (operations, (UNITS / "kvoffloadd.service").read_text()):
        assert record in text and f"/dev/shm/kvoffload-{cfg.instance}@" in text
    assert "`--keep-region`" in operations


def test_a_disk_tier_has_a_writable_home_under_the_sandbox() -> None:
    """ProtectSystem=strict leaves only the StateDirectory writable: the example's disk
    tier path lies inside it, and the daemon's own uid owns it, 0700."""
    svc = unit("kvoffloadd.service")["Service"]
    assert one(svc, "ProtectSystem") == "strict"
    state = f"/var/lib/{one(svc, 'StateDirectory')}"
    assert one(svc, "StateDirectoryMode") == "0700"
    example = (UNITS / "kvoffloadd.toml.example").read_text()
    disk = re.search(r'^# path = "([^"]+)"', example, re.M)
    assert disk is not None and disk.group(1).startswith(state + "/")
    documented = tomllib.loads(
        re.search(r"```toml\n(.*?)```", TIERS.read_text(), re.S).group(1)  # type: ignore[union-attr]
    )
    disk_tiers = [t for t in documented["tiers"] if t["type"] == "disk"]
    assert disk_tiers and all(t["path"].startswith(state + "/") for t in disk_tiers)
    assert not any(k in svc for k in ("ReadOnlyPaths", "InaccessiblePaths"))


def test_the_service_and_socket_agree_with_each_other_and_the_docs() -> None:
    svc, sock = unit("kvoffloadd.service")["Service"], unit("kvoffloadd.socket")["Socket"]
    sysusers = (UNITS / "kvoffload.sysusers.conf").read_text()
    user = one(svc, "User")
    assert re.search(rf"^u {user} ", sysusers, re.M)
    assert one(svc, "Group") == one(sock, "SocketGroup") == user == one(sock, "SocketUser")
    path = one(sock, "ListenStream")
    assert path.startswith(f"/run/{one(svc, 'RuntimeDirectory')}/")  # the lock file's home
    assert (one(sock, "SocketMode"), one(sock, "DirectoryMode")) == ("0660", "0750")
    for page in (OPERATIONS, ROOT / "README.md"):
        assert f"KVOFFLOAD_SOCKET={path}" in page.read_text(), page.name
    # descriptors: every client the daemon admits by default, twice over, plus the reserve
    assert int(one(svc, "LimitNOFILE")) >= 2 * DaemonConfig().max_clients + FD_RESERVE
    assert one(svc, "LimitMEMLOCK") == "infinity"
    assert one(svc, "Type") == "notify" and one(svc, "Restart") == "on-failure"
