"""Building blocks for storage tiers: what the bundled tiers share, public for third-party ones.

A tier (``slidekit.interfaces.StorageTier``) moves bytes between tensors and
its own storage on worker threads. Four things every such tier needs, each
easy to get subtly wrong, are here:

* ``byte_view(t)``: a contiguous host or CUDA tensor as a flat ``uint8``
  view (no copy), refusing, with the fix, what a tier must not move: a
  non-tensor, a non-contiguous tensor, a tensor on another device type.
* ``Counters``: bytes written and read, counted from any thread, turned into
  ``TierStats`` by ``stats(...)``.
* ``caller_ready(...)`` and ``StreamCopier``: a CUDA source may still be
  being produced, and a CUDA destination still be in use, by kernels queued
  on the caller's current stream when ``write``/``read`` is called. So the
  tier records an event on that stream *at call time* (``caller_ready``, on
  the caller's thread), and the worker copies on a side stream of its own
  that first waits for that event, then synchronises, so that the future the
  tier returns completes only once the bytes have arrived
  (``StreamCopier.copy``, on the worker thread). Host-only copies need no
  event and are plain ``copy_``.
* ``IoPool``: the worker threads, whose ``close`` waits for work in flight
  at most ``timeout_s`` (a stuck read on a hung disk must not hang the
  run's shutdown forever), then warns, naming the tier, and leaves the stuck
  threads behind; ``close`` returns whether everything finished, so the tier
  knows whether it may release the memory or files that work still uses.

A host-memory tier with them (``tests/test_tierkit.py`` runs the tier
conformance checks on exactly this code)::

    import torch
    from slidekit.tierkit import Counters, IoPool, StreamCopier, byte_view, caller_ready

    class MyTier:
        name = "my_tier"

        def __init__(self, ctx):
            self._regions = {}
            self._pool = IoPool(ctx.io_threads, tier=self.name, timeout_s=ctx.close_timeout_s)
            self._copier = StreamCopier()
            self._counters = Counters()

        def allocate(self, key, nbytes):
            if key in self._regions or nbytes < 0:
                raise ValueError(f"region {key!r} exists already, or {nbytes} < 0 bytes")
            self._regions[key] = torch.zeros(nbytes, dtype=torch.uint8)

        def map(self, key):
            return self._regions[key]

        def free(self, key):
            self._regions.pop(key, None)

        def _move(self, key, t, offset, write):
            data = byte_view(t)  # (n,) uint8, host or CUDA; refuses what cannot be moved
            region = self._regions[key]  # KeyError names an unknown region
            if offset < 0 or offset + data.numel() > region.numel():
                raise ValueError(f"{data.numel()} bytes at {offset} leave region {key!r}")
            span = region[offset : offset + data.numel()]
            dst, src = (span, data) if write else (data, span)
            ready = caller_ready(data)  # now, on the caller's thread: None for host tensors

            def run():
                self._copier.copy(dst, src, ready, non_blocking=False)  # the bytes are there after it
                self._counters.add(**{"written" if write else "read": data.numel()})

            return self._pool.submit(run)

        def write(self, key, src, offset=0):
            return self._move(key, src, offset, True)

        def read(self, key, dst, offset=0):
            return self._move(key, dst, offset, False)

        def stats(self):
            allocated = sum(r.numel() for r in self._regions.values())
            return self._counters.stats(allocated=allocated, capacity=None, detail="host memory")

        def close(self):
            if self._pool.close():  # False: I/O is stuck, and may still use the regions
                self._regions.clear()

The bundled ``ram``, ``gpu``, ``posix`` and ``gds`` tiers, and the example
plugin in ``docs/examples``, are built on this module.

Test: ``pytest tests/test_tierkit.py`` (and each tier's conformance tests).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Final, ParamSpec, TypeVar

import torch

from slidekit.interfaces import TierStats

__all__ = [
    "Counters",
    "IoPool",
    "StreamCopier",
    "byte_view",
    "caller_ready",
]

_DEVICE_TYPES: Final = ("cpu", "cuda")

P = ParamSpec("P")
T = TypeVar("T")


# --------------------------------------------------------------------------- byte views


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat ``uint8`` view of its bytes, (n,) with n = numel * element size; no copy.

    Raises ``TypeError`` for a non-tensor and ``ValueError`` for a
    non-contiguous tensor or one that is neither on the CPU nor on a CUDA
    (or ROCm) device, each naming the fix. Autograd is detached: a tier moves
    the bytes, never a graph.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"storage tiers move torch tensors, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError("storage tiers move contiguous tensors only; call .contiguous() first")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(
            f"storage tiers move cpu or cuda tensors, got a tensor on {t.device}; move it with .to() first"
        )
    return t.detach().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- counters


class Counters:
    """Bytes a tier has written and read, counted from any thread, for ``stats()``.

    Count a transfer once its bytes have arrived (a failed one is not counted).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written = 0
        self._read = 0

    def add(self, *, written: int = 0, read: int = 0) -> None:
        if written < 0 or read < 0:
            raise ValueError(f"byte counts only grow: got written={written}, read={read}")
        with self._lock:
            self._written += written
            self._read += read

    @property
    def written(self) -> int:
        with self._lock:
            return self._written

    @property
    def read(self) -> int:
        with self._lock:
            return self._read

    def stats(self, *, allocated: int, capacity: int | None, detail: str) -> TierStats:
        """The counters, with what only the tier knows, as ``TierStats`` (one consistent snapshot)."""
        with self._lock:
            written, read = self._written, self._read
        return TierStats(
            bytes_written=written,
            bytes_read=read,
            bytes_allocated=allocated,
            capacity=capacity,
            detail=detail,
        )


# --------------------------------------------------------------------------- ordered copies


def caller_ready(*tensors: torch.Tensor) -> Any:
    """An event recorded now on the caller's current stream, or None when no tensor is on CUDA.

    Call it on the caller's thread when ``write``/``read`` is called, before
    handing the transfer to a worker: everything queued on that stream so far
    (kernels producing a source, or still reading a destination) happens
    before the event. The stream is that of the first CUDA tensor's device.
    """
    for t in tensors:
        if t.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            return event
    return None


class StreamCopier:
    """Copies on worker threads, ordered after the caller's stream, through one side stream per thread.

    Share one per tier; call ``copy`` from its worker threads.
    """

    def __init__(self) -> None:
        self._local = threading.local()  # .streams: this thread's side stream per CUDA device

    def stream(self, device: torch.device) -> Any:
        """This thread's side stream on ``device`` (made on first use)."""
        streams: dict[torch.device, Any] | None = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ready: Any, *, non_blocking: bool = True) -> None:
        """``dst.copy_(src)``, returning once the bytes are in ``dst``.

        ``ready``: ``caller_ready(...)`` of the transfer (None: a plain copy,
        for host tensors). With an event, the copy runs on this thread's side
        stream after the event, and the stream is synchronised before this
        returns. ``non_blocking``: pass False where host memory is pageable.
        """
        if ready is None:
            dst.copy_(src)
            return
        device = src.device if src.device.type == "cuda" else dst.device
        stream = self.stream(device)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)  # what the caller queued before the call comes first
            dst.copy_(src, non_blocking=non_blocking)
        stream.synchronize()  # the future promises the bytes have arrived (and buffers get reused)


# --------------------------------------------------------------------------- worker threads


class IoPool:
    """A tier's worker threads (``slidekit-<tier>_N``) whose ``close`` never waits forever.

    Args:
        threads: how many workers (at least one).
        tier: the tier's name, for thread names and the warning.
        timeout_s: the longest ``close`` waits for work in flight (a tier passes
            ``TierContext.close_timeout_s``).
    """

    def __init__(self, threads: int, *, tier: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the {tier} tier's close timeout must be > 0 seconds, got {timeout_s!r}")
        self.tier = tier
        self.threads = max(1, threads)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"slidekit-{tier}")
        self._lock = threading.Lock()
        self._inflight: set[Future[Any]] = set()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker; its future. Raises RuntimeError once closed."""
        future = self._pool.submit(fn, *args, **kwargs)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._finished)  # runs at once if it is done already
        return future

    def _finished(self, future: Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(future)

    def close(self) -> bool:
        """Cancel work not started; wait at most ``timeout_s`` for running work; True if all finished.

        Then the workers are joined. If some work is still running after
        ``timeout_s``, a ``RuntimeWarning`` names the tier and how many tasks
        are stuck, their threads are left behind, and this returns False: the
        tier must then keep whatever that work may still touch (buffers,
        files). Calling it again is harmless.
        """
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._inflight)
        _, stuck = wait(running, timeout=self.timeout_s)
        if stuck:
            warnings.warn(
                f"closing the {self.tier} tier: {len(stuck)} I/O task(s) still running after "
                f"{self.timeout_s:g} s (a hung disk or device?); their threads are left behind, and the "
                "memory or files they use stay until the process exits",
                RuntimeWarning,
                stacklevel=2,
            )
            return False
        self._pool.shutdown(wait=True)  # nothing runs: the workers only have to see the end
        return True
