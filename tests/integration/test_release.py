"""A release a user can install: ``python -m build`` makes an sdist and, from it, a
wheel; the wheel installs into a fresh virtualenv with its dependencies from the package
index (never torch), and the daemon, the admin CLI and the plug-ins it installs run.

The wheel is built from the sdist (``python -m build``'s default), so a file missing
from the sdist fails here too.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

from kvoffload.version import __version__
from kvoffloadbench.launch import DaemonProcess

ROOT = Path(__file__).parents[2]
# What the build reads: the packages, their metadata, what the sdist carries.
SOURCES = ("daemon", "libclient", "tools", "pyproject.toml", "README.md", "MANIFEST.in")
SHIPPED = ("systemd", "deploy", "docs", "CHANGELOG.md")
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "*.so")


def run(*argv: str | Path, timeout_s: float = 120.0) -> str:
    """Run a command; on failure the assertion carries its output's end."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{out[-3000:]}"
    )
    return out


def test_the_wheel_installs_into_a_fresh_virtualenv_and_serves(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build writes egg-info and build/ beside it
    for name in (*SOURCES, *SHIPPED):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=IGNORE)
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, src)
    sdist = dist / f"kvoffload-{__version__}.tar.gz"
    # the C copy loop and key set make it a wheel for this interpreter and platform
    wheels = sorted(dist.glob(f"kvoffload-{__version__}-cp3*-linux_*.whl"))
    assert len(wheels) == 1 and sorted(p.name for p in dist.iterdir()) == sorted(
        [wheels[0].name, sdist.name]
    ), sorted(p.name for p in dist.iterdir())
    wheel = wheels[0]
    listing = run("tar", "tzf", sdist)
    for c in ("libclient/kvoffload/datapath/_copyrun.c", "daemon/kvoffloadd/index/_keyset.c"):
        assert f"kvoffload-{__version__}/{c}" in listing, f"the sdist lacks {c}"
    for name in ("systemd/kvoffloadd.service", "systemd/kvoffloadd.toml.example", "CHANGELOG.md"):
        assert f"kvoffload-{__version__}/{name}" in listing, f"the sdist lacks {name}"

    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    bin_ = env / "bin"
    run(bin_ / "pip", "install", "--disable-pip-version-check", "-q", wheel, timeout_s=240)
    installed = run(bin_ / "pip", "list", "--disable-pip-version-check", "--format=freeze")
    names = {
        line.split("==")[0].lower().replace("-", "_")
        for line in installed.splitlines()
        if "==" in line
    }
    assert {"kvoffload", "numpy", "msgspec", "posix_ipc", "blake3"} <= names
    assert "torch" not in names, "the wheel pulled torch: engines bring their own"

    for tool in ("kvoffloadd", "kvoffloadctl"):
        assert run(bin_ / tool, "--version").strip() == f"{tool} {__version__}"
    # the plug-ins import without their engines (which load them by module path)
    run(
        bin_ / "python",
        "-c",
        "import kvoffload.vllm, kvoffload.sglang, kvoffload.vllm.identity, "
        "kvoffload.sglang.identity",
    )
    native = "from kvoffload.datapath import memruns; print(memruns.NATIVE)"
    assert run(bin_ / "python", "-c", native).strip() == "True", "the wheel lacks the C copy loop"
    native = "from kvoffloadd.index import keyset; print(keyset.NATIVE)"
    assert run(bin_ / "python", "-c", native).strip() == "True", "the wheel lacks the C key set"
    native = "from kvoffloadd.index import policies; print(policies.NATIVE)"
    assert run(bin_ / "python", "-c", native).strip() == "True", "the wheel lacks the C Block"

    with DaemonProcess("64MiB", "--no-prefault", command=[str(bin_ / "kvoffloadd")]) as d:
        assert f"listening on {d.socket_path}" in d.banner
        assert "pong in" in run(bin_ / "kvoffloadctl", "--socket", d.socket_path, "ping")
        assert d.stop() == 0
