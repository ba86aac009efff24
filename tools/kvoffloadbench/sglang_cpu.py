"""Import SGLang 0.5.23's cache controller on a CPU-only machine (tests and benchmarks).

What cannot import without a GPU is replaced here, at import time, and nothing else:

- ``torchvision``: SGLang's model configs import it at module level
  (``sglang.srt.configs`` -> ``multimodal/internvl_utils.py``), on the way to the host
  pools and the cache controller. PyPI's torchvision wheels are built against CUDA
  torch and fail to load against the local CPU build ("operator torchvision::nms does
  not exist"), and a matching CPU build is not on PyPI. No code path the cache
  controller runs calls into torchvision, so a stand-in module tree is served
  (``_StubModule``: every attribute is another stand-in), plus a distribution record
  "torchvision 0.28.0" so that transformers' version probe finds a version.

``install()`` is idempotent and must run before the first SGLang import. It also points
``TORCH_EXTENSIONS_DIR`` into the virtualenv (unless set), so SGLang's page-hash C++
extension, built on first use, is built once per virtualenv (``make test-sglang``
builds it at install time).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys
import types
from collections.abc import Iterable, Sequence
from typing import Any

STUBBED = "torchvision"
STUB_VERSION = "0.28.0"


class _StubModule(types.ModuleType):
    """A module whose every missing attribute is a callable stand-in."""

    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        stub = _StubModule(f"{self.__name__}.{name}")
        setattr(self, name, stub)
        return stub

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return _StubModule(f"{self.__name__}()")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # ``class X(torchvision.Foo)`` at import time


class _StubDistribution(importlib.metadata.Distribution):
    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {STUBBED}\nVersion: {STUB_VERSION}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return path


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == STUBBED or fullname.startswith(STUBBED + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__version__ = STUB_VERSION  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == STUBBED:
            return [_StubDistribution()]
        return []


def install() -> None:
    """Serve the stand-ins; call before importing SGLang."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    venv_ext = os.path.join(sys.prefix, "torch-extensions")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", venv_ext)


def build_extension() -> None:
    """Build SGLang's page-hash extension now (once per virtualenv) and check it."""
    install()
    import hashlib
    import struct

    from sglang.srt.mem_cache.utils import get_hash_str

    want = hashlib.sha256(struct.pack("<4I", 0, 1, 2, 3)).hexdigest()
    got = get_hash_str(list(range(4)))
    if got != want:
        raise SystemExit(f"SGLang's page hash gave {got}, expected {want}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build the page-hash extension")
    if parser.parse_args().build:
        build_extension()
