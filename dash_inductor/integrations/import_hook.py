"""Run a callback right after a module is imported, without importing it ourselves.

Registering with transformers must not import it: ``import transformers.modeling_utils`` takes
seconds and transformers is optional. So when the module is not loaded yet, a finder on
``sys.meta_path`` waits for its import, lets the real loader execute it, then runs the callback
once and steps out of the way (the module keeps its own loader and spec).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """Delegates to the module's real loader and runs the callback after execution."""

    def __init__(self, finder: "_Finder", loader: importlib.abc.Loader) -> None:
        self._finder, self._loader = finder, loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._finder.fire(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the spec the other finders return for one name."""

    def __init__(self, name: str, callback: Callback) -> None:
        self.name, self.callback = name, callback
        self._searching = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or getattr(self._searching, "active", False):
            return None
        self._searching.active = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(self, spec.loader)
        return spec

    def fire(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback(module)


def _waiting(name: str, callback: Callback) -> list[_Finder]:
    return [f for f in sys.meta_path
            if isinstance(f, _Finder) and (f.name, f.callback) == (name, callback)]


def after_import(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported: now if it already is, else on import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if not _waiting(name, callback):
        sys.meta_path.insert(0, _Finder(name, callback))


def waiting(name: str, callback: Callback) -> bool:
    """Whether ``callback`` waits for the import of ``name`` (registered, not yet called)."""
    return bool(_waiting(name, callback))


def cancel(name: str, callback: Callback) -> None:
    """Drop ``callback`` if it still waits for the import of ``name``."""
    for finder in _waiting(name, callback):
        sys.meta_path.remove(finder)
