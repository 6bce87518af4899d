"""The backward schedules and kernel paths: their one definition, in plain Python.

Everything that names a schedule or asks about one (config, launchers, the DAG model in
``dash_inductor/model/schedule.py``, the benchmarks, the docs) imports it from here; the ``@triton.jit``
formulas in ``ops/shared/schedules.py`` take their constexpr ids from here. No torch, no triton: this
module sits below every other layer (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The value of ``schedule`` that lets the launcher pick (``ops.portable.configs.auto_schedule``).
AUTO = "auto"


@dataclass(frozen=True)
class Schedule:
    """One backward schedule and the properties the launcher, the kernels and the model rely on."""

    name: str
    id: int  #: the kernels' ``SCHEDULE`` constexpr
    ordered: bool  #: dQ is reduced in a fixed order per Q tile, enforced by ticket waits
    deterministic: bool  #: the gradients' bits depend on the inputs only
    coresident_head: bool  #: a head's work items wait on each other both ways: all must run at once
    paired_when_causal: bool  #: causal: KV tiles i and n_kv-1-i share one work item (two slots)
    separate_dq: bool  #: dQ is computed by a second kernel, not reduced by the main one

    def slots(self, causal: bool) -> int:
        """KV tiles per work item."""
        return 2 if causal and self.paired_when_causal else 1

    def items_per_head(self, n_kv: int, causal: bool) -> int:
        """Work items per (batch, KV head) for ``n_kv`` KV tiles."""
        if not isinstance(n_kv, int) or isinstance(n_kv, bool) or n_kv < 1:
            raise ValueError(f"n_kv must be a positive int (KV tiles per head), got {n_kv!r}")
        return (n_kv + 1) // 2 if causal and self.paired_when_causal else n_kv


_ALL = (
    Schedule("ascending", 0, ordered=True, deterministic=True, coresident_head=False,
             paired_when_causal=False, separate_dq=False),
    Schedule("descending", 1, ordered=True, deterministic=True, coresident_head=False,
             paired_when_causal=False, separate_dq=False),
    Schedule("shift", 2, ordered=True, deterministic=True, coresident_head=True,
             paired_when_causal=True, separate_dq=False),
    Schedule("recompute", 3, ordered=False, deterministic=True, coresident_head=False,
             paired_when_causal=False, separate_dq=True),
    Schedule("atomic", 4, ordered=False, deterministic=False, coresident_head=False,
             paired_when_causal=False, separate_dq=False),
)

SCHEDULES: dict[str, Schedule] = {s.name: s for s in _ALL}
#: Every schedule name, in id order.
NAMES: tuple[str, ...] = tuple(SCHEDULES)
ORDERED: tuple[str, ...] = tuple(s.name for s in _ALL if s.ordered)
DETERMINISTIC: tuple[str, ...] = tuple(s.name for s in _ALL if s.deterministic)

#: Kernel paths: "auto" lets the launcher pick (``ops/dispatch.py``), "portable" is the ``tl``
#: kernels of ``ops/``, "hopper" the sm90 family.
KERNELS: tuple[str, ...] = ("auto", "portable", "hopper")


def get(name: str) -> Schedule:
    """The schedule called ``name``; ValueError naming the choices otherwise."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"schedule must be one of {list(NAMES)}, got {name!r}") from None


def fallback(causal: bool) -> str:
    """The ordered schedule that runs on any grid, used when a schedule's head cannot fit."""
    return "descending" if causal else "ascending"


def is_ordered(name: str) -> bool:
    """Whether ``name``'s dQ reduction is ordered by waits."""
    return get(name).ordered


def num_slots(causal: bool, name: str) -> int:
    """KV tiles per work item: 2 for causal shift (KV tiles i and n_kv-1-i share a program), else 1."""
    return get(name).slots(causal)


def items_per_head(n_kv: int, causal: bool, name: str) -> int:
    """Work items per (batch, KV head)."""
    return get(name).items_per_head(n_kv, causal)


def needs_coresident_head(name: str) -> bool:
    """True when a head's work items wait on each other both ways (shift): they must run at once."""
    return get(name).coresident_head
