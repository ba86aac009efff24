"""Default locations shared by the daemon, the client and the CLI."""

from __future__ import annotations

import os


def default_runtime_dir() -> str:
    """``$XDG_RUNTIME_DIR/kvoffload``, or ``/tmp/kvoffload-$UID`` when that is unset."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvoffload")
    return f"/tmp/kvoffload-{os.getuid()}"


def default_socket_path(instance: str = "default") -> str:
    name = "kvoffloadd.sock" if instance == "default" else f"kvoffloadd-{instance}.sock"
    return os.path.join(default_runtime_dir(), name)
