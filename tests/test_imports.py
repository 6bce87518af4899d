"""The package's import graph has no cycle, function-level imports included (read from the source,
not from what an import happens to load): each layer imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each package's modules live (``dash_inductor.ops`` is the ``ops/`` folder).
PACKAGES = {"dash_inductor": ROOT / "dash_inductor", "dash_inductor.ops": ROOT / "ops"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name.startswith("dash_inductor.ops") and package == "dash_inductor":
                continue  # a link or copy of ops/ inside the package folder
            modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
            # ``from pkg import module`` needs pkg's __init__ anyway; ``from pkg import name``
            # reads the name from it.
            targets = names if all(n in modules for n in names) else names + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_in_the_package():
    modules = _modules()
    # A package's __init__ re-exports its modules: importing a module of a package runs its
    # __init__ first, so edges into an __init__ are what could close a cycle.
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_launchers_import_neither_the_dispatcher_nor_each_other():
    modules = _modules()
    launchers = ["dash_inductor.ops.portable.forward", "dash_inductor.ops.portable.backward",
                 "dash_inductor.ops.portable.packed", "dash_inductor.ops.hopper.launch"]
    for launcher in launchers:
        imported = _imports(launcher, modules[launcher], modules)
        assert "dash_inductor.ops.dispatch" not in imported, launcher
        others = set(launchers) - {launcher}
        # The packed launcher runs the dense kernels' VARLEN variants: it calls their launch
        # helpers, which are kernels' entry points, not launchers of plans.
        allowed = {"dash_inductor.ops.portable.forward", "dash_inductor.ops.portable.backward"} \
            if launcher.endswith("packed") else set()
        assert not (imported & others) - allowed, (launcher, imported & others)


def test_the_documented_names_import():
    """Every name the docs tell users to import, from where they say."""
    import dash_inductor
    from dash_inductor import config, integrations, testing  # noqa: F401
    from dash_inductor.ops import (Plan, cache_clear, cache_info, catalog,  # noqa: F401
                                   check_spin_flags)
    from dash_inductor.library.op import last_plans  # noqa: F401

    for name in ("attention", "varlen_attention", "explain", "enable", "disable", "config",
                 "unsupported_reason", "integrations", "testing"):
        assert hasattr(dash_inductor, name) or name == "testing", name
    assert callable(check_spin_flags) and cache_info().maxsize > 0
