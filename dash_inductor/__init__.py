"""dash_inductor: fast, bitwise-reproducible attention for PyTorch training.

``attention`` is a deterministic drop-in for ``torch.nn.functional.scaled_dot_product_attention``
(no dropout); the op is ``torch.ops.dash.attention``. Importing this package registers the op.
"""

from . import config
from .library import attention, unsupported_reason

__all__ = ["attention", "config", "unsupported_reason"]
__version__ = "0.1.0"
