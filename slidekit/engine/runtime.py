"""Threads, streams and the one error that stops them.

``Pipeline`` owns the engine's worker lanes, one thread each:

* ``h2d``: uploads unit parameters to the compute device;
* ``d2h``: copies gradients down into the host ring;
* ``optim``: runs the CPU optimizer over one unit at a time, in order.

Tiers run their I/O on threads of their own. Tasks only ever wait on work
further along the fixed order h2d -> optim -> d2h -> (tier I/O), and the
optimizer runs its tasks strictly in submission order, so no task can wait on
one queued behind it: the pipeline cannot deadlock. (A speculating step's
optimizer tasks each take one of the step's waiting units, not necessarily the
one they were queued for, ``slidekit.engine.speculation``; they still wait on
downloads alone.)

The first exception on any thread is stored; every wait in the engine
(``result``, ``wait_until``) checks it and re-raises that very exception, so
it reaches the caller of ``fit`` within one poll interval. No wait is
unbounded: once nothing in the pipeline has made progress (no task finished,
no wait returned) for ``timeout_s`` it raises ``PipelineStalled``, naming the
lane and the unit that holds everything up (followed through the tasks each
waiter waits on) and marking that task stuck.

A lane is a daemon thread of the pipeline's own, not a
``concurrent.futures`` worker (those are joined at interpreter exit): a task
that never returns can neither keep ``close`` waiting beyond ``timeout_s``
(a task already declared stuck is not waited for at all) nor keep the
process from exiting.

``Streams`` hides CUDA streams and events behind calls that are no-ops on
the CPU, so the same scheduler runs in both places.

Test: ``pytest tests/engine/test_runtime.py tests/test_stalls.py``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from slidekit.errors import PipelineError, PipelineStalled

__all__ = ["POOLS", "Pipeline", "Streams"]

T = TypeVar("T")

POOLS = ("h2d", "d2h", "optim")
_POLL_S = 0.05


@dataclass(eq=False)
class _Task:
    """One piece of work on a lane, and what it is doing now (read by stall reports)."""

    lane: str
    unit: int | None
    future: _TaskFuture
    fn: Callable[[], Any] = field(repr=False)
    started: float | None = None  # time.monotonic() when it began running; None while queued
    waiting: tuple[Future[Any] | None, str] | None = None  # inside a pipeline wait: (future or None, what)
    stuck: bool = False  # declared stalled: close() does not wait for it

    def describe(self, now: float) -> str:
        unit = "" if self.unit is None else f" unit {self.unit}"
        ran = now - (self.started or now)
        if self.waiting is None:
            return f"the {self.lane} lane has been running{unit} for {ran:.1f} s without returning"
        return f"the {self.lane} lane is on{unit}, waiting for {self.waiting[1]}"


class _TaskFuture(Future[Any]):
    """A future whose producer the pipeline knows: a lane, a unit, and the task when there is one."""

    def __init__(self, lane: str, unit: int | None) -> None:
        super().__init__()
        self.lane = lane
        self.unit = unit
        self.task: _Task | None = None


class _Lane:
    """One daemon thread running a lane's tasks in submission order."""

    def __init__(self, name: str, on_done: Callable[[], None]) -> None:
        self.name = name
        self._on_done = on_done
        self._cond = threading.Condition()
        self._queue: deque[_Task] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.current: _Task | None = None

    def submit(self, task: _Task) -> None:
        with self._cond:
            if self._stopping:
                raise PipelineError("the pipeline is closed; build a new Trainer")
            self._queue.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"slidekit-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                if not task.future.set_running_or_notify_cancel():
                    continue
                task.started = time.monotonic()
                self.current = task
            try:
                task.future.set_result(task.fn())
            except BaseException as exc:  # stored on the future, like concurrent.futures does
                task.future.set_exception(exc)
            finally:
                with self._cond:
                    self.current = None
                self._on_done()
            del task  # hold no finished task's arguments while idle

    def stop(self) -> None:
        """Cancel what is queued; the thread ends once its current task returns."""
        with self._cond:
            self._stopping = True
            for task in self._queue:
                task.future.cancel()
            self._queue.clear()
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; True when it has (or never started)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(max(0.0, timeout))
        return not thread.is_alive()


class Pipeline:
    """The engine's worker lanes, error propagation and bounded waits."""

    def __init__(
        self,
        timeout_s: float,
        *,
        task_hook: Callable[[str], None] | None = None,
        on_fail: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.task_hook = task_hook  # called with the lane name before every task: fault/delay injection
        self.on_fail = on_fail  # called with the first failure (a data-parallel rank reports it to its peers)
        self._lanes = {name: _Lane(name, self._progressed) for name in POOLS}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._local = threading.local()  # .task: the task running on this thread (lane threads only)
        self._progress = time.monotonic()  # when a task last finished or a wait last returned

    # ------------------------------------------------------------------ errors

    @property
    def error(self) -> BaseException | None:
        return self._error

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and wake every waiter."""
        with self._cond:
            first = self._error is None
            if first:
                self._error = exc
            self._cond.notify_all()
        if first and self.on_fail is not None:
            self.on_fail(exc)

    def check(self) -> None:
        """Re-raise the first failure of any thread, if there was one."""
        if self._error is not None:
            raise self._error

    def notify(self) -> None:
        """Wake waiters after shared state changed (a slot or buffer was freed)."""
        self._progressed()
        with self._cond:
            self._cond.notify_all()

    def _progressed(self) -> None:
        self._progress = time.monotonic()

    # ------------------------------------------------------------------ tasks

    def submit(self, pool: str, fn: Callable[..., T], *args: Any, unit: int | None = None) -> Future[T]:
        """Run ``fn(*args)`` on lane ``pool`` after the tasks queued there; ``unit`` names it in reports."""
        if self._closed:
            raise PipelineError("the pipeline is closed; build a new Trainer")
        self.check()
        lane = self._lanes[pool]
        fut = _TaskFuture(pool, unit)

        def run() -> T:
            self._local.task = task
            try:
                if self._error is not None:  # something already failed: do no more work
                    raise PipelineError("cancelled after an earlier failure") from self._error
                if self.task_hook is not None:
                    self.task_hook(pool)
                return fn(*args)
            except BaseException as exc:
                self.fail(exc)
                raise
            finally:
                self._local.task = None

        task = fut.task = _Task(pool, unit, fut, run)
        lane.submit(task)
        return fut

    def promise(self, pool: str, unit: int | None = None) -> Future[Any]:
        """A future that a task on lane ``pool`` will complete for ``unit``; a stall report follows it there."""
        if pool not in self._lanes:
            raise KeyError(f"no lane {pool!r}; lanes: {', '.join(POOLS)}")
        return _TaskFuture(pool, unit)

    def result(self, fut: Future[T], what: str) -> T:
        """Wait for ``fut``; re-raise any pipeline failure; fail once nothing progressed for ``timeout_s``."""
        start = time.monotonic()
        with self._waiting(fut, what):
            while True:
                done, _ = wait_futures([fut], timeout=_POLL_S)
                if done:
                    if self._error is not None and (fut.cancelled() or fut.exception() is not None):
                        raise self._error
                    self._progressed()
                    return fut.result()
                self.check()
                if self._stalled(start):
                    raise self._stall(fut, what, start)

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Block until ``predicate()`` holds (re-checked whenever ``notify`` is called)."""
        start = time.monotonic()
        with self._waiting(None, what), self._cond:
            while not predicate():
                if self._error is not None:
                    raise self._error
                if self._stalled(start):
                    raise self._stall(None, what, start)
                self._cond.wait(_POLL_S)

    def poll(self, done: Callable[[], bool], what: str, *, check: Callable[[], None] | None = None) -> None:
        """Block until ``done()`` holds, for work that completes without telling anyone (a collective).

        ``done`` is polled at intervals growing from 0.1 ms to 5 ms, so a quick completion is seen
        quickly; ``check()`` (a peer's failure report) runs between polls and may raise. Bounded like
        every wait: a pipeline failure re-raises, no progress for ``timeout_s`` raises
        ``PipelineStalled``.
        """
        start = time.monotonic()
        delay = 1e-4
        with self._waiting(None, what):
            while not done():
                self.check()
                if check is not None:
                    check()
                if self._stalled(start):
                    raise self._stall(None, what, start)
                time.sleep(delay)
                delay = min(2 * delay, 5e-3)
        self._progressed()

    @property
    def lock(self) -> threading.Condition:
        """The condition guarding shared pipeline state; ``notify`` wakes its waiters."""
        return self._cond

    def drain(self) -> None:
        """Wait for every queued task to finish (errors are left to ``check``)."""
        for pool in POOLS:
            self.result(self.submit(pool, lambda: None), f"the {pool} queue to drain")

    def close(self) -> None:
        """Stop accepting work, cancel what is queued, and give running tasks up to ``timeout_s`` to end.

        A task declared stuck by a stall is not waited for; one still running at the deadline is left to
        its daemon thread with a warning. Either way ``close`` returns within ``timeout_s``.
        """
        if self._closed:
            return
        self._closed = True
        with self._cond:
            if self._error is None:
                self._error = PipelineError("the pipeline was closed")
            self._cond.notify_all()
        for lane in self._lanes.values():
            lane.stop()
        deadline = time.monotonic() + self.timeout_s
        for lane in self._lanes.values():
            task = lane.current
            if task is not None and task.stuck:
                continue  # already reported in the PipelineStalled that stopped the run
            if not lane.join(deadline - time.monotonic()) and (task := lane.current) is not None:
                warnings.warn(
                    f"closing the pipeline: {task.describe(time.monotonic())}; its thread is left behind",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # ------------------------------------------------------------------ stall reports

    @contextmanager
    def _waiting(self, fut: Future[Any] | None, what: str) -> Iterator[None]:
        """Note, for stall reports, what the task on this thread (if any) is waiting for."""
        task: _Task | None = getattr(self._local, "task", None)
        if task is None:
            yield
            return
        before, task.waiting = task.waiting, (fut, what)
        try:
            yield
        finally:
            task.waiting = before

    def _stalled(self, start: float) -> bool:
        return time.monotonic() - max(start, self._progress) > self.timeout_s

    def _blocker(self, fut: Future[Any] | None) -> _Task | None:
        """The running task that ``fut`` waits on: its own, or the one ahead of it on its lane."""
        if not isinstance(fut, _TaskFuture) or fut.done():
            return None
        if fut.task is not None and fut.task.started is not None:
            return fut.task
        return self._lanes[fut.lane].current

    def _stall(self, fut: Future[Any] | None, what: str, start: float) -> PipelineStalled:
        """The error for a wait on ``fut`` (None: a condition) that saw no progress: who holds it up."""
        me: _Task | None = getattr(self._local, "task", None)
        chain: list[_Task] = []
        task = self._blocker(fut)
        while task is not None and task is not me and task not in chain:
            chain.append(task)
            task = self._blocker(task.waiting[0]) if task.waiting is not None else None
        root = chain[-1] if chain else me
        end = root.waiting if root is not None else (fut, what)
        if end is not None and end[0] is None:
            # Waiting for a condition (a free buffer or cache unit) that some task should bring about:
            # blame the task that has been running longest without waiting for anything, if any.
            running = [
                t for lane in self._lanes.values() if (t := lane.current) is not None and t.waiting is None
            ]
            if running:
                root = min(running, key=lambda t: t.started or 0.0)
        now = time.monotonic()
        if root is None:
            culprit, lane, unit = f"the main thread is waiting for {what}", "main", None
        else:
            root.stuck = True
            culprit, lane, unit = root.describe(now), root.lane, root.unit
        waited = ""
        if root is not me:
            waiter = "The main thread" if me is None else f"The {me.lane} lane"
            via = " -> ".join(
                f"the {t.lane} lane" + ("" if t.unit is None else f" (unit {t.unit})") for t in chain
            )
            waited = f" {waiter} waited for {what}" + (f", held up by {via}." if via else ".")
        return PipelineStalled(
            f"the pipeline made no progress for {now - max(start, self._progress):.0f} s: {culprit}.{waited} "
            "A driver call or tier I/O that never completes is stuck there; if the work is merely slow, "
            f"raise engine.timeout_s (now {self.timeout_s:g} s)",
            lane=lane,
            unit=unit,
        )


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
