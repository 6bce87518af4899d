"""How the C++ replayer is found or built (ops/shared/native.py), with PyTorch's builder replaced
by a stand-in that records its calls: no compile runs here, and no test can wait on a lock.

What these show: an existing build is imported without PyTorch's builder (whose lock file a dead
process may have left); a lock file left with no build is removed before building; a build that
cannot be imported (cut short while linking) is built again. What they cannot: a real compile
(tests/test_native.py builds one) or two processes racing to build.
"""

import sys

import pytest
from torch.utils import cpp_extension

from dash_inductor.ops.shared import native

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the lock is flock's")


class Builder:
    """Stands in for ``cpp_extension.load``: notes what the build directory held when called."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, sources, extra_cflags, build_directory, verbose):
        held = sorted(p.name for p in native.Path(build_directory).iterdir())
        self.calls.append({"name": name, "directory": build_directory, "held": held})
        return f"built {name}"


@pytest.fixture
def builder(monkeypatch):
    stand_in = Builder()
    monkeypatch.setattr(cpp_extension, "load", stand_in)
    return stand_in


@pytest.fixture(scope="module")
def module():
    if not native.ENABLED:
        pytest.skip("DASH_INDUCTOR_NATIVE=0")
    loaded = native.load(wait=True)  # the real build (module scope: before the stand-in)
    assert loaded is not None, native.failure()
    return loaded


def test_a_build_that_exists_is_imported_without_the_builder(module, builder):
    directory = native.Path(module.__file__).parent
    stale = directory / "lock"
    stale.touch()  # what a process killed while building leaves behind
    try:
        again = native._load_or_build(native._name(), directory)
    finally:
        stale.unlink()
    assert builder.calls == []
    assert again.__file__ == module.__file__


def test_a_lock_left_without_a_build_is_removed_before_building(builder, tmp_path):
    (tmp_path / "lock").touch()
    assert native._load_or_build("dash_native_probe", tmp_path) == "built dash_native_probe"
    assert builder.calls == [{"name": "dash_native_probe", "directory": str(tmp_path),
                              "held": ["dash.lock"]}]


def test_a_build_that_cannot_be_imported_is_built_again(builder, tmp_path):
    broken = tmp_path / "dash_native_probe.so"
    broken.write_bytes(b"not a shared library")
    assert native._load_or_build("dash_native_probe", tmp_path) == "built dash_native_probe"
    assert builder.calls[0]["held"] == ["dash.lock"]


def test_the_name_is_a_module_name_of_this_python_and_torch():
    name = native._name()
    assert name.isidentifier()
    assert sys.implementation.cache_tag.replace("-", "_") in name


def test_without_locks_a_lock_file_is_left_to_pytorch(builder, tmp_path, monkeypatch):
    import fcntl

    def refuse(*args):
        raise OSError("no locks on this filesystem")

    monkeypatch.setattr(fcntl, "flock", refuse)
    (tmp_path / "lock").touch()  # it may be a live build's: not ours to remove
    assert native._load_or_build("dash_native_probe", tmp_path) == "built dash_native_probe"
    assert builder.calls[0]["held"] == ["dash.lock", "lock"]
