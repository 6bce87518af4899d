"""``attn_implementation="dash"`` for Hugging Face transformers models.

transformers looks attention functions up by name in ``AttentionInterface`` and builds each
model's mask with the function registered under the same name in ``AttentionMaskInterface``.
dash takes the masks SDPA takes, so "dash" reuses transformers' SDPA mask builder (a boolean
4-D mask, or None with ``is_causal`` for a plain causal mask; sliding windows and padding arrive
folded into that mask; a T5-style ``position_bias`` is added to it as a float mask). A call dash's
op cannot take runs transformers' own attention instead (SDPA's function, or the model's eager one
for soft-capping, attention sinks and attention weights), counted and logged by ``routes``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from dash_inductor.library.entry import attention
from dash_inductor.library.op import unsupported_reason

from dash_inductor.integrations import routes

NAME = "dash"
_BY_EAGER = "; transformers' eager attention runs it"
#: Keyword arguments for features dash's op does not have, with why. Soft-capping and attention
#: sinks go to the model's own eager attention: transformers' SDPA function raises on the first
#: and would drop the second without a word.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping (softcap) is not supported by dash.attention" + _BY_EAGER,
    "s_aux": "attention sinks (s_aux) are not supported by dash.attention" + _BY_EAGER,
    "cache": "a paged cache is left to transformers' SDPA path",
}
_WEIGHTS = "output_attentions=True needs the attention weights, which dash does not return"
#: The fallbacks that run the model's eager attention; every other one runs transformers' SDPA.
_EAGER_REASONS = {_UNSUPPORTED_KWARGS["softcap"], _UNSUPPORTED_KWARGS["s_aux"],
                  _WEIGHTS + _BY_EAGER}


def _reason(query: Tensor, key: Tensor, value: Tensor, mask: Any, dropout: float,
            is_causal: bool, scaling: float | None, kwargs: dict[str, Any]) -> str | None:
    for name, reason in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            return reason
    if kwargs.get("output_attentions"):
        return _WEIGHTS + _BY_EAGER
    if mask is not None and not isinstance(mask, Tensor):
        return f"attention_mask of type {type(mask).__name__} (dash takes tensor masks)"
    return unsupported_reason(query, key, value, mask, dropout, is_causal, scaling,
                              enable_gqa=key.shape[1] != query.shape[1])


def _additive(mask: Tensor | None, causal: bool, query: Tensor, key: Tensor) -> Tensor | None:
    """The mask as transformers' eager functions add it to the scores (0, or the dtype's minimum
    where a bool mask is False). SDPA's mask builder leaves a plain causal mask as None; it is
    built here, top-left aligned as SDPA's ``is_causal``."""
    if mask is None and causal:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool,
                          device=query.device).tril()[None, None]
    if mask is None or mask.dtype != torch.bool:
        return mask
    minimum = torch.finfo(query.dtype).min
    zeros = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device)
    return zeros.masked_fill(~mask, minimum)


def _eager_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     mask: Tensor | None, causal: bool, dropout: float, scaling: float | None,
                     kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """The attention function that the model's own modeling file defines for "eager"."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"dash_inductor: {type(module).__name__} needs transformers' eager attention (soft-"
            f"capping, attention sinks or attention weights) and {type(module).__module__} "
            f"defines no eager_attention_forward; use attn_implementation='eager' for this model")
    return eager(module, query, key, value, _additive(mask, causal, query, key), dropout=dropout,
                 scaling=scaling, **kwargs)


def dash_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature: (B, H, L, E) inputs, (B, L, H, Ev) output."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' SDPA path: a plain causal mask arrives as None, and one query row
    # (decoding) attends to every key.
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    mask, mask_causal = attention_mask, causal
    bias = kwargs.get("position_bias")
    if bias is not None and (attention_mask is None or isinstance(attention_mask, Tensor)):
        # T5-style relative position bias: one additive float mask (the bias plus the model's
        # mask) as transformers' SDPA path builds; dash.attention returns its gradient.
        extra = _additive(attention_mask, causal, query, key)
        mask, mask_causal = (bias if extra is None else bias + extra), False
    others = {name: value for name, value in kwargs.items() if name != "position_bias"}
    reason = _reason(query, key, value, mask, dropout, mask_causal, scaling, others)
    routes.record("hf", reason)
    if reason in _EAGER_REASONS:
        return _eager_attention(module, query, key, value, attention_mask, causal, dropout,
                                scaling, kwargs)
    if reason is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = attention(query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=mask_causal,
                    scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
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
