"""The passes as Inductor's hooks hold them: a ``ChainedPass`` per hook runs the pass(es) the hook
held before, then dash's, and gives Inductor's caches its ``uuid()``.

Imported once Inductor is (``rewrite.install``). The patterns themselves (``rewrite_sdpa.py``,
``rewrite_fused.py``) are imported when a pass first runs, inside a compilation: Inductor's
pattern matcher imports its lowerings, about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from dash_inductor import config
from dash_inductor.inductor.sites import recorders, rewrite_enabled
from dash_inductor.library import op as library


def _pre_grad(graph: torch.fx.Graph) -> None:
    from dash_inductor.inductor import rewrite_sdpa

    rewrite_sdpa.pre_grad(graph)


def _joint(graph: torch.fx.Graph) -> None:
    from dash_inductor.inductor import rewrite_fused

    rewrite_fused.joint(graph)


def _as_passes(hook_value: Any) -> tuple[Callable[..., Any], ...]:
    """The passes held by an Inductor hook: None, one callable, or (2.13+) a list or tuple."""
    if hook_value is None:
        return ()
    if isinstance(hook_value, (list, tuple)):
        return tuple(hook_value)
    return (hook_value,)


class ChainedPass(CustomGraphPass):
    """One Inductor hook's pass: the pass(es) the hook held before, then ours.

    Holding the user's value unchanged (a callable, or a list on torch 2.13+) and calling it from
    here works on every supported torch, whether the hook takes one callable or a list, and
    ``uninstall()`` puts back exactly that value.
    """

    def __init__(self, hook: str, rewrite: Callable[[torch.fx.Graph], Any]) -> None:
        self.hook = hook
        self.rewrite = rewrite
        self.chained: Any = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in _as_passes(self.chained):
            user_pass(graph)
        if rewrite_enabled() or recorders:
            self.rewrite(graph)

    def uuid(self) -> Any:
        """Source hash, the current decision and the choices the pass bakes into the op calls;
        None (no caching) if a chained pass has no uuid."""
        chained = []
        for user_pass in _as_passes(self.chained):
            user_uuid = user_pass.uuid() if isinstance(user_pass, CustomGraphPass) else None
            if user_uuid is None:
                return None
            chained.append(user_uuid)
        return (self.hook, _SOURCE_HASH, rewrite_enabled(), tuple(config.choices().items()),
                tuple(chained))

    def __reduce__(self) -> tuple[Callable[[str], ChainedPass], tuple[str, Any]]:
        """Pickle by name, with the uuid alongside: some torch versions pickle Inductor's config
        (hooks included) into cache keys or for compile workers, and the pattern tables behind
        this object (ops with C++ handles) do not pickle."""
        return _installed_pass, (self.hook, self.uuid())

    @property
    def installed(self) -> bool:
        return getattr(inductor_config, self.hook) is self

    def install(self) -> None:
        if self.installed:
            return
        self.chained = getattr(inductor_config, self.hook)
        setattr(inductor_config, self.hook, self)

    def uninstall(self) -> None:
        if self.installed:
            setattr(inductor_config, self.hook, self.chained)
            self.chained = None


#: The passes' code and the op's schema/fake kernels/acceptance rules decide the rewritten graph.
_SOURCES = ("passes.py", "rewrite_sdpa.py", "rewrite_fused.py", "mha.py", "sites.py",
            "unmatched.py")
_SOURCE_HASH = get_hash_for_files(
    (*(str(Path(__file__).with_name(name)) for name in _SOURCES), library.__file__))
PRE_GRAD_PASS = ChainedPass("pre_grad_custom_pass", _pre_grad)
JOINT_PASS = ChainedPass("joint_custom_post_pass", _joint)
PASSES = (PRE_GRAD_PASS, JOINT_PASS)


def _installed_pass(hook: str, uuid: Any = None) -> ChainedPass:
    """The module's pass for an Inductor hook (what a pickled ``ChainedPass`` loads as)."""
    return {PRE_GRAD_PASS.hook: PRE_GRAD_PASS, JOINT_PASS.hook: JOINT_PASS}[hook]
