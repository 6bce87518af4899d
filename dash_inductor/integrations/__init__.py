"""Where dash meets code that calls attention without torch.compile.

- Hugging Face transformers: ``attn_implementation="dash"`` (``hf``), registered when
  transformers' modeling code is imported, or at once if it already is (``import_hook``).
- PyTorch's flash-attention provider registry: "DASH" (``provider``; ``provider_varlen`` for
  ``varlen_attn``), registered on import, activated only by ``activate_provider()`` or
  ``torch.nn.attention.activate_flash_attention_impl``.

Each call either runs dash's op or goes on to PyTorch's attention; ``routes`` counts both and
logs why on the ``dash_inductor`` logger.
"""

from __future__ import annotations

import importlib
import logging

import torch

from dash_inductor.integrations import hf, kernel_support, provider, provider_varlen, routes
from dash_inductor.integrations.import_hook import after_import
from dash_inductor.integrations.routes import dash_calls, fallbacks
from dash_inductor.integrations.routes import reset as reset_counts

log = logging.getLogger("dash_inductor")


def install() -> None:
    """Register everything that can be registered without importing anything optional."""
    provider.register()
    after_import("transformers.modeling_utils", hf.register_attention)
    after_import("transformers.masking_utils", hf.register_mask)


def register_hf() -> None:
    """Register ``attn_implementation="dash"`` now, importing transformers' modeling code
    (``import dash_inductor`` already does this lazily; call it to fail early if it cannot)."""
    try:
        modeling_utils = importlib.import_module("transformers.modeling_utils")
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError as error:
        raise ImportError("attn_implementation='dash' needs transformers "
                          "(python -m pip install transformers)") from error
    hf.register_attention(modeling_utils)
    hf.register_mask(masking_utils)


def activate_provider() -> str:
    """Make "DASH" PyTorch's flash-attention implementation; returns (and logs) what changed."""
    api = provider.registry()
    if api is None:
        raise RuntimeError(provider.missing_registry_message())
    previous = api.current_flash_attention_impl()
    provider.register()
    api.activate_flash_attention_impl(provider.NAME)
    varlen = ("and varlen_attn runs dash.varlen_attention"
              if provider_varlen.unavailable_reason() is None else "(varlen_attn stays PyTorch's)")
    message = (f"dash_inductor: activated flash-attention implementation {provider.NAME!r} "
               f"(was {previous or 'PyTorch default'}): on CUDA, SDPA's flash backend now runs "
               f"dash.attention {varlen}; calls dash cannot take go to PyTorch's kernels with "
               f"the reason logged; dash_inductor.integrations.deactivate_provider() undoes it")
    if not torch.cuda.is_available():
        message += ". No CUDA device here: the flash backend, and so this provider, does not run"
    log.info(message)
    return message


def deactivate_provider() -> str:
    """Give SDPA's flash backend back to PyTorch if "DASH" is active; returns what it did."""
    api = provider.registry()
    if api is None:
        return provider.missing_registry_message()
    current = api.current_flash_attention_impl()
    if current != provider.NAME:
        message = (f"dash_inductor: {provider.NAME!r} is not active (active: "
                   f"{current or 'PyTorch default'}); nothing changed")
    else:
        api.restore_flash_attention_impl()
        message = f"dash_inductor: deactivated {provider.NAME!r}; SDPA's flash backend is PyTorch's"
    log.info(message)
    return message


__all__ = ["activate_provider", "dash_calls", "deactivate_provider", "fallbacks", "hf",
           "install", "kernel_support", "provider", "provider_varlen", "register_hf",
           "reset_counts", "routes"]
