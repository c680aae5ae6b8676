"""The example plugin's momentum SGD, for the tests that need an optimizer that is not Adam.

``MomentumSGD`` is ``docs/examples/slidekit-example-tier/slidekit_example_tier/sgd.py``, loaded from
its file (the example is a separate distribution, installed only by ``tests/test_example_plugin.py``),
so the docs and the tests share one implementation of ``torch.optim.SGD(momentum, weight_decay)``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SGD_FILE = (
    Path(__file__).resolve().parents[1]
    / "docs"
    / "examples"
    / "slidekit-example-tier"
    / "slidekit_example_tier"
    / "sgd.py"
)


def _load() -> type:
    spec = importlib.util.spec_from_file_location("example_momentum_sgd", SGD_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the example optimizer from {SGD_FILE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MomentumSGD


MomentumSGD = _load()
