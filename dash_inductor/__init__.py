"""dash_inductor: fast, bitwise-reproducible attention for PyTorch training.

``attention`` is a deterministic drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(no dropout); the op is ``torch.ops.dash.attention``. Importing this package registers the op and
installs the Inductor pass that rewrites SDPA into it under ``torch.use_deterministic_algorithms``.
"""

from . import config, integrations
from .library import attention, unsupported_reason
from .rewrite import explain
from .rewrite import install as enable
from .rewrite import uninstall as disable

enable()
integrations.install()  # registers, never activates: see dash_inductor.integrations

__all__ = ["attention", "config", "disable", "enable", "explain", "integrations",
           "unsupported_reason"]
__version__ = "0.1.0"
