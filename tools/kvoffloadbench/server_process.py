"""A throwaway server process for tests and benchmarks: its own session and temporary
directory, stopped with SIGTERM (SIGKILL after 10 s), or killed at once as in a crash."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from types import TracebackType
from typing import Any


class ServerProcess:
    proc: subprocess.Popen[bytes] | None = None
    _dir = ""

    def spawn(self, args: list[str], prefix: str) -> subprocess.Popen[bytes]:
        """Start ``args`` in a fresh temporary directory, output discarded."""
        self._dir = tempfile.mkdtemp(prefix=prefix)
        self.proc = subprocess.Popen(
            args,
            cwd=self._dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.proc

    def start(self) -> Any:
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
