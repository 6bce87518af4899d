"""The C++ replayer of recorded programs (``native.cpp``), built once per torch version and source.

PyTorch builds it with the host's C++ compiler on first use (``torch.utils.cpp_extension``,
cached under ``TORCH_EXTENSIONS_DIR``), in a thread of its own: calls take the Python path until
it has loaded, then the same programs run from C++, so the bits do not depend on which ran. It
is off where ``DASH_INDUCTOR_NATIVE=0``, and where it cannot build (no compiler): then a
warning says why, once.

A build that exists is imported as it is. Builds are serialised by a lock that the OS releases
when its process ends: PyTorch's own lock file outlives a process that exits or is killed while
building (the build thread is a daemon), and every later build would wait on it forever.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import itertools
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from . import driver

#: Whether the replayer may take new signatures, from ``DASH_INDUCTOR_NATIVE`` ("1" or "0");
#: set it and call ``dash_inductor.ops.cache_clear()`` to switch (benchmarks compare both).
_SETTING = os.environ.get("DASH_INDUCTOR_NATIVE", "1")
if _SETTING not in ("0", "1"):
    raise ValueError(f"DASH_INDUCTOR_NATIVE={_SETTING!r}: expected '1' or '0'")
ENABLED = _SETTING == "1"

_SOURCE = Path(__file__).with_name("native.cpp")
#: What the build reads: the headers too, which PyTorch's rebuild check does not hash.
_FILES = [_SOURCE, *(_SOURCE.with_name(f"native_{part}.h") for part in ("ops", "program", "table"))]
_module: ModuleType | None = None
_failed: str | None = None
_building: threading.Thread | None = None
_lock = threading.Lock()
_numbers = itertools.count()  #: the host's numbering of launches until the replayer loads


def _name() -> str:
    """The build's name: this Python's ABI, this torch, and the sources' contents."""
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in _FILES)).hexdigest()[:12]
    name = f"dash_native_{sys.implementation.cache_tag}_{torch.__version__}_{digest}"
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` that the OS drops with this process (``flock``); yields
    whether it could (not on Windows, nor on a filesystem without locks)."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_or_build(name: str, directory: Path) -> ModuleType:
    """The build ``name`` in ``directory``: imported where it exists, else built there."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    with _exclusive(directory / "dash.lock") as locked:
        if library.exists():
            try:
                return _import(name, library)
            except ImportError:  # a build that died while linking: build it again
                library.unlink()
        if locked:  # no build runs now: PyTorch's lock file is one a dead process left
            (directory / "lock").unlink(missing_ok=True)
        return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"],
                                  build_directory=str(directory), verbose=False)


def _build() -> None:
    global _module, _failed
    from torch.utils import cpp_extension

    name = _name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    try:
        module = _load_or_build(name, Path(root) / name)
    except Exception as error:  # a missing compiler or headers: the Python path stays
        _failed = f"{type(error).__name__}: {error}".splitlines()[0]
        warnings.warn(f"dash attention: the C++ replayer did not build ({_failed}); calls keep "
                      f"the Python launch path", RuntimeWarning, stacklevel=2)
        return
    module.start_sequence(next(_numbers))
    _module = module


def load(wait: bool = False) -> ModuleType | None:
    """The replayer, or None while it builds (``wait``: until it has), is off or failed."""
    global _building
    if not ENABLED:
        return None
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _building is None:
            _building = threading.Thread(target=_build, name="dash-native-build", daemon=True)
            _building.start()
    if wait:
        _building.join()
    return _module


def loaded() -> ModuleType | None:
    """The replayer if it has loaded (never starts a build)."""
    return _module


def next_number() -> int:
    """The next number of the sequence that orders the host's and the replayer's launches
    (``last_plans()``)."""
    module = _module
    return module.next_sequence() if module is not None else next(_numbers)


def launch_hooked() -> bool:
    """Whether a profiler has set Triton's launch hooks, which see Python's launches only: the
    calls then take the Python path. (Triton is imported by then if a signature was recorded.)"""
    knobs = sys.modules.get("triton.knobs")
    if knobs is None:
        return False
    runtime = knobs.runtime
    return bool(driver.active(runtime.launch_enter_hook) or driver.active(runtime.launch_exit_hook))


def failure() -> str | None:
    """Why the replayer did not build, or None."""
    return _failed
