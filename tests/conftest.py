"""Shared fixtures: tiny model directories per family, a GPU skip marker, and hypothesis' settings.

Property tests run under the ``slidekit`` hypothesis profile: no per-example deadline (hypothesis'
default of 200 ms fails an example that a loaded machine merely ran slowly) and no ``too_slow``
health check (it times data generation). What a test checks never depends on how fast it ran; see
docs/testing.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import suite_order
import torch
from hypothesis import HealthCheck, settings

from slidekit.testing.models import save_tiny_model

settings.register_profile("slidekit", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("slidekit")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model(family, **overrides)``: a saved tiny HF model directory (cached per arguments)."""
    cache: dict[tuple, Path] = {}

    def make(family: str, **overrides: object) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{family}-model")
            cache[key] = save_tiny_model(family, directory, **overrides)
        return cache[key]

    return make


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the GPU gate's pytest-xdist workers: the last gate's slowest tests first (``suite_order.reorder``)."""
    suite_order.reorder(config, items)
