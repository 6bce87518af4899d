"""Sliding windows with FlashAttention's meaning: validation, the keep-mask, and its canonical form.

``window_size = (left, right)``: query ``i`` attends to key ``j`` when ``i + offset - left <= j``
(if ``left >= 0``) and ``j <= i + offset + right`` (if ``right >= 0``); -1 leaves that side open.
``offset`` aligns the diagonal: 0 for ``dash.attention`` (top-left, like its ``is_causal``),
``S - L`` per sequence for ``varlen_attention`` (bottom-right, as FlashAttention's kernels).
``is_causal`` composes as in FlashAttention: it sets ``right`` to 0, i.e. the mask is the
intersection of the causal mask and the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Window = tuple[int, int]
NO_WINDOW: Window = (-1, -1)
#: The largest side the ops' ``int[2] window_size`` (int64) holds.
MAX_SIDE = 2**63 - 1


def check_window(window_size: Sequence[int], where: str) -> Window:
    """``window_size`` as a (left, right) tuple of ints in [-1, ``MAX_SIDE``], or a ValueError
    naming it."""
    if window_size is NO_WINDOW:  # the default, already canonical
        return NO_WINDOW
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence) \
            or len(window_size) != 2:
        raise ValueError(f"{where}: window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: window_size {name} must be an int, got {value!r}")
        if not -1 <= value <= MAX_SIDE:
            raise ValueError(f"{where}: window_size values must be >= -1 and <= 2**63 - 1 (int64; "
                             f"-1 = no limit on that side), got window_size={tuple(window_size)}")
    return int(left), int(right)


def with_causal(window: Window, is_causal: bool) -> tuple[Window, bool]:
    """(window, is_causal) in canonical form: a right side of 0 *is* the causal mask, so it moves
    to ``is_causal`` (the kernels' causal path skips the tiles above the diagonal), and
    ``is_causal`` intersected with any right side leaves the causal mask."""
    left, right = window
    if is_causal or right == 0:
        return (left, -1), True
    return (left, right), False


def keep(rows: Tensor, cols: Tensor, window: Window, offset: int = 0) -> Tensor | None:
    """True where query ``rows`` may attend to key ``cols`` (broadcast), None for no window."""
    left, right = window
    result = None
    if left >= 0:
        result = cols >= rows + offset - left
    if right >= 0:
        upper = cols <= rows + offset + right
        result = upper if result is None else result & upper
    return result


def dense_keep(l: int, s: int, window: Window, device: torch.device,
               offset: int = 0) -> Tensor | None:
    """The (L, S) boolean keep-mask of a window; None when the window masks nothing."""
    rows = torch.arange(l, device=device)[:, None]
    cols = torch.arange(s, device=device)[None, :]
    return keep(rows, cols, window, offset)

