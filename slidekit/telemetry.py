"""What a run reports while it trains: a progress bar with loss and throughput.

``Progress`` wraps tqdm; it writes to stderr and disappears when disabled,
so library use stays quiet and the CLI shows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A progress bar over the steps of a run, showing loss and tokens/s."""

    def __init__(self, total: int, *, enabled: bool, desc: str = "finetune") -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, float]) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix(
            loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}", refresh=False
        )
        self._bar.update(1)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
