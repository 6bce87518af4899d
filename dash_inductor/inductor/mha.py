"""``nn.MultiheadAttention`` with dropout in training, taken in the pre-grad graph.

Dynamo keeps ``F.multi_head_attention_forward`` as one node there, so its SDPA call first appears
in the joint graph, fused with SDPA's own RNG state, which the joint pass cannot give dash's
dropout. Without dropout that is fine: the joint pass takes the fused call. With dropout the
pre-grad pass points the node at :func:`multi_head_attention_forward` below, which runs PyTorch's
own function and sends its SDPA call to ``dash_inductor.attention``: AOTAutograd then traces
dash's op and its ``dash::dropout_rng`` draw, as for a user's own SDPA call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dash_inductor.inductor.unmatched import mha_arguments
from dash_inductor.library.entry import attention
from dash_inductor.library.op import unsupported_reason


def drops(node: torch.fx.Node) -> bool:
    """Whether this ``F.multi_head_attention_forward`` call applies attention dropout: training
    mode with ``dropout_p > 0``, both known at compile time."""
    args = mha_arguments(node)
    if args is None:
        return False
    dropout, training = args["dropout_p"], args["training"]
    return training is True and isinstance(dropout, (int, float)) and dropout > 0


#: PyTorch's function, and the module global it calls SDPA through.
_MHA, _SDPA = F.multi_head_attention_forward, F.scaled_dot_product_attention


def _dash_or_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    """SDPA's signature: dash where it takes the call, else SDPA."""
    if unsupported_reason(*args, **kwargs) is None:
        return attention(*args, **kwargs)
    return _SDPA(*args, **kwargs)


def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward``, its SDPA call made by dash (with its dropout).

    PyTorch's function calls SDPA through ``torch.nn.functional``'s global, which is pointed at
    dash for the call. AOTAutograd runs this while it traces (the compiled graph holds the ops
    it called, not this function), one graph at a time; a torch-function mode cannot do it, as a
    mode is off inside the handler of the ``multi_head_attention_forward`` call around SDPA's.
    """
    F.scaled_dot_product_attention = _dash_or_sdpa
    try:
        return _MHA(*args, **kwargs)
    finally:
        F.scaled_dot_product_attention = _SDPA
