"""Suite-wide set-up: the Triton interpreter on machines without CUDA, the ``gpu`` marker, and the
project's own pytest plugin (hypothesis profiles, determinism fixtures)."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must precede the first import of triton (by dash's first launch, or by Inductor): Triton
    # decides at import whether its own library functions run in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the package is installed, pytest has loaded the plugin already (its entry point): a no-op.
pytest_plugins = ["dash_inductor.pytest_plugin"]


@pytest.fixture
def fresh_compiles(deterministic_algorithms):
    """Compile from scratch under deterministic algorithms: Dynamo reset (models that share a
    forward wrapper would otherwise add up to its recompile limit, past which it runs them
    eagerly) and no Inductor or AOTAutograd cache, so that every compile runs the passes."""
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
