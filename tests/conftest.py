"""Shared fixtures: tiny model directories per family, and a GPU skip marker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slidekit.testing.models import save_tiny_model


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
