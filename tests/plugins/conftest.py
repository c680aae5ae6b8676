"""Fixtures shared by the plugin tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the optimizers' reference paths run tens of tiny parallel ops per chunk, which
    crawl on a shared 2-core machine. Results do not depend on it (each optimizer's thread-count test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
