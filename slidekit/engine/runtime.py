"""Threads, streams and the one error that stops them.

``Pipeline`` owns the engine's worker threads:

* ``h2d``: uploads unit parameters to the compute device;
* ``d2h``: copies gradients down into the host ring;
* ``optim``: runs the CPU optimizer over one unit at a time, in order.

Tiers run their I/O on threads of their own. Tasks only ever wait on work
further along the fixed order h2d -> optim -> d2h -> (tier I/O), and the
optimizer handles units strictly in submission order, so no task can wait on
one queued behind it: the pipeline cannot deadlock.

The first exception on any thread is stored; every wait in the engine
(``result``, ``wait_until``) checks it and re-raises that very exception, so
it reaches the caller of ``fit`` within one poll interval. No wait is
unbounded: past ``timeout_s`` it raises ``PipelineStalled``.

``Streams`` hides CUDA streams and events behind calls that are no-ops on
the CPU, so the same scheduler runs in both places.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import torch

from slidekit.errors import PipelineError, PipelineStalled

__all__ = ["POOLS", "Pipeline", "Streams"]

T = TypeVar("T")

POOLS = ("h2d", "d2h", "optim")
_POLL_S = 0.05


class Pipeline:
    """The engine's worker threads, error propagation and bounded waits."""

    def __init__(self, timeout_s: float, *, task_hook: Callable[[str], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.task_hook = task_hook  # called with the lane name before every task: fault/delay injection
        self._pools = {name: ThreadPoolExecutor(1, thread_name_prefix=f"slidekit-{name}") for name in POOLS}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------ errors

    @property
    def error(self) -> BaseException | None:
        return self._error

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and wake every waiter."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def check(self) -> None:
        """Re-raise the first failure of any thread, if there was one."""
        if self._error is not None:
            raise self._error

    def notify(self) -> None:
        """Wake waiters after shared state changed (a slot or buffer was freed)."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ tasks

    def submit(self, pool: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed:
            raise PipelineError("the pipeline is closed; build a new Trainer")
        self.check()

        def run() -> T:
            try:
                if self._error is not None:  # something already failed: do no more work
                    raise PipelineError("cancelled after an earlier failure") from self._error
                if self.task_hook is not None:
                    self.task_hook(pool)
                return fn(*args)
            except BaseException as exc:
                self.fail(exc)
                raise

        return self._pools[pool].submit(run)

    def result(self, fut: Future[T], what: str) -> T:
        """Wait for ``fut``; re-raise any pipeline failure; never longer than the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            done, _ = wait_futures([fut], timeout=_POLL_S)
            if done:
                if self._error is not None and fut.exception() is not None:
                    raise self._error
                return fut.result()
            self.check()
            if time.monotonic() > deadline:
                raise PipelineStalled(f"waited {self.timeout_s:.0f}s for {what}; the pipeline is stuck")

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Block until ``predicate()`` holds (re-checked whenever ``notify`` is called)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not predicate():
                if self._error is not None:
                    raise self._error
                if time.monotonic() > deadline:
                    raise PipelineStalled(f"waited {self.timeout_s:.0f}s for {what}; the pipeline is stuck")
                self._cond.wait(_POLL_S)

    @property
    def lock(self) -> threading.Condition:
        """The condition guarding shared pipeline state; ``notify`` wakes its waiters."""
        return self._cond

    def drain(self) -> None:
        """Wait for every queued task to finish (errors are left to ``check``)."""
        for pool in POOLS:
            self.result(self._pools[pool].submit(lambda: None), f"the {pool} queue to drain")

    def close(self) -> None:
        """Stop accepting work, cancel what is queued and join the threads."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            if self._error is None:
                self._error = PipelineError("the pipeline was closed")
            self._cond.notify_all()
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=True)


class Streams:
    """Compute, upload and download streams on CUDA; nothing on the CPU.

    Every method is a no-op on the CPU, where copies run synchronously on the
    worker threads and compute runs on the caller's thread.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.compute: Any = torch.cuda.current_stream(device)
            self.h2d: Any = torch.cuda.Stream(device)
            self.d2h: Any = torch.cuda.Stream(device)
        else:
            self.compute = self.h2d = self.d2h = None

    def record(self, stream: Any) -> Any:
        """An event marking everything queued on ``stream`` so far (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` on the device, without blocking the host."""
        if self.cuda and event is not None:
            stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """Block this host thread until ``event`` has completed."""
        if self.cuda and event is not None:
            event.synchronize()

    def use(self, stream: Any) -> Any:
        """Context manager making ``stream`` current (a null context on the CPU)."""
        if self.cuda:
            return torch.cuda.stream(stream)
        import contextlib

        return contextlib.nullcontext()
