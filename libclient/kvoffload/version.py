"""The version of kvoffload (the daemon, the client library, the admin CLI and the
plug-ins ship as one distribution): its one place. ``pyproject.toml`` reads it for the
distribution's metadata; ``kvoffloadd --version`` and ``kvoffloadctl --version`` print
it, and the daemon reports it at ``Hello`` and in its stats."""

__version__ = "0.2.0"
