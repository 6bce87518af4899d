"""``attn_implementation="dash"`` for Hugging Face transformers models.

transformers looks attention functions up by name in ``AttentionInterface`` and builds each
model's mask with the function registered under the same name in ``AttentionMaskInterface``.
dash takes the masks SDPA takes, so "dash" reuses transformers' SDPA mask builder (a boolean
4-D mask, or None with ``is_causal`` for a plain causal mask; sliding windows and padding arrive
folded into that mask). A call dash's op cannot take runs transformers' own SDPA function instead,
counted and logged by ``routes``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from dash_inductor.library import attention, unsupported_reason

from . import routes

NAME = "dash"
#: Keyword arguments transformers passes for features dash's op does not have, with why.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping (softcap) is not supported by dash.attention",
    "s_aux": "attention sinks (s_aux) are not supported by dash.attention",
    "position_bias": "a per-layer position_bias is left to transformers' SDPA path",
    "cache": "a paged cache is left to transformers' SDPA path",
}


def _reason(query: Tensor, key: Tensor, value: Tensor, mask: Any, dropout: float,
            is_causal: bool, scaling: float | None, kwargs: dict[str, Any]) -> str | None:
    for name, reason in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            return reason
    if kwargs.get("output_attentions"):
        return "output_attentions=True needs the attention weights, which dash does not return"
    if mask is not None and not isinstance(mask, Tensor):
        return f"attention_mask of type {type(mask).__name__} (dash takes tensor masks)"
    return unsupported_reason(query, key, value, mask, dropout, is_causal, scaling,
                              enable_gqa=key.shape[1] != query.shape[1])


def dash_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: (B, H, L, E) inputs, (B, L, H, Ev) output."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA path: a plain causal mask arrives as None, and one query row
    # (decoding) attends to every key.
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    reason = _reason(query, key, value, attention_mask, dropout, causal, scaling, kwargs)
    routes.record("hf", reason)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                    is_causal=causal, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_attention(modeling_utils: ModuleType) -> None:
    """Register the attention function in ``transformers.modeling_utils.AttentionInterface``."""
    modeling_utils.AttentionInterface.register(NAME, dash_attention_forward)


def register_mask(masking_utils: ModuleType) -> None:
    """Register SDPA's mask builder for "dash" (transformers without this interface build the
    masks of custom implementations as they do for SDPA; nothing to do there)."""
    interface = getattr(masking_utils, "AttentionMaskInterface", None)
    if interface is not None:
        interface.register(NAME, masking_utils.sdpa_mask)


def registered() -> bool:
    """Whether "dash" is in transformers' attention interface (False if it is not imported)."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return modeling_utils is not None and NAME in modeling_utils.AttentionInterface._global_mapping
