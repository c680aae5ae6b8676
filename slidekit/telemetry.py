"""What a run reports while it trains: a progress bar, and where each step's time went.

``Progress`` wraps tqdm; it writes to stderr and disappears when disabled,
so library use stays quiet and the CLI shows it. ``Timeline`` records the
time every pipeline lane spent per unit, from which the engine reports
per-step totals and the hiding factor eta = T_bwd / (T_d2h + T_update).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Progress", "Timeline"]


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


class Timeline:
    """What each lane of the pipeline spent on each unit during one step.

    Host spans (``host``) time work on a thread with ``perf_counter``: the
    optimizer update, the gradient download (copy and wait), the main thread
    stalled waiting for an upload or a free cache unit. Device spans
    (``device``) bracket work queued on a CUDA stream with events, resolved
    when the step ends; on the CPU they are host spans, since compute there
    is synchronous. ``finish`` returns seconds per lane and clears the record.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._lock = threading.Lock()
        self._host: list[tuple[str, int, float, float]] = []
        self._device: list[tuple[str, int, Any, Any]] = []

    @contextlib.contextmanager
    def host(self, lane: str, unit: int) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._host.append((lane, unit, t0, t1))

    @contextlib.contextmanager
    def device(self, lane: str, unit: int, stream: Any) -> Iterator[None]:
        if not self.cuda:
            with self.host(lane, unit):
                yield
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._device.append((lane, unit, start, end))

    def finish(self) -> dict[str, float]:
        """Seconds per lane over the step (device events are waited for), then reset."""
        with self._lock:
            host, device = self._host, self._device
            self._host, self._device = [], []
        totals: dict[str, float] = {}
        for lane, _, t0, t1 in host:
            totals[lane] = totals.get(lane, 0.0) + (t1 - t0)
        for lane, _, start, end in device:
            end.synchronize()
            totals[lane] = totals.get(lane, 0.0) + start.elapsed_time(end) / 1e3
        return totals
