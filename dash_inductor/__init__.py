"""dash_inductor: fast, bitwise-reproducible attention for PyTorch training.

``attention`` is a deterministic drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(dropout included, seeded from PyTorch's generator); the op is ``torch.ops.dash.attention``.
``varlen_attention`` is the same for packed sequences (without dropout), with
``torch.nn.attention.varlen.varlen_attn``'s signature. Importing this package
registers the ops and installs the Inductor pass that rewrites SDPA into ``dash.attention`` under
``torch.use_deterministic_algorithms``.
"""

from dash_inductor import config, distributed, integrations
from dash_inductor.library.entry import attention
from dash_inductor.library.op import unsupported_reason
from dash_inductor.inductor.rewrite import explain
from dash_inductor.inductor.rewrite import install as enable
from dash_inductor.inductor.rewrite import uninstall as disable
from dash_inductor.library.varlen import varlen_attention

enable()
integrations.install()  # registers, never activates: see dash_inductor.integrations
distributed.install()  # DTensor sharding rules, once torch.distributed.tensor is imported

__all__ = ["attention", "config", "disable", "distributed", "enable", "explain", "integrations",
           "unsupported_reason", "varlen_attention"]
__version__ = "0.1.0"
