"""What ``CheckpointWriter.save`` hands back (``SaveHandle``) and takes (``Deferred`` tensors)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

# --------------------------------------------------------------------------- writing


class SaveHandle:
    """One save in progress: a future per tensor and one for the commit.

    A tensor's future completes (result None) once its array is written and hashed: the writer never
    reads that tensor again, so the caller may modify it. If the save fails first, the future raises the
    save's ``CheckpointError`` instead, and the tensor is released all the same. Tensor futures complete
    in the order the tensors were given, and all of them before the commit future.
    """

    def __init__(self, step: int, names: Sequence[str], path: Path) -> None:
        self.step = step
        self.path = path  # where the checkpoint is once committed
        self._tensors: dict[str, Future[None]] = {n: Future() for n in names}
        self._commit: Future[Path] = Future()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def future(self, name: str) -> Future[None]:
        """The future of one tensor (see the class docstring)."""
        try:
            return self._tensors[name]
        except KeyError:
            have = list(self._tensors)
            raise KeyError(
                f"checkpoint step {self.step} saves no tensor {name!r}; it saves {have[:8]}"
            ) from None

    def wait_for(self, *names: str, timeout: float | None = None) -> None:
        """Block until every named tensor is written; raise the save's error if it failed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in names:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.future(name).result(left)
            except TimeoutError:
                raise TimeoutError(
                    f"checkpoint step {self.step}: {name!r} not written within {timeout} s; the checkpoint "
                    "writer is stalled (slow or hung storage?)"
                ) from None

    def done(self) -> bool:
        return self._commit.done()

    def result(self, timeout: float | None = None) -> Path:
        """The committed checkpoint's path (retention has run); raises ``CheckpointError`` if the save failed."""
        try:
            return self._commit.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"checkpoint step {self.step} not committed within {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's ``CheckpointError`` (its cause chained), or None once committed."""
        return self._commit.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` on the writer thread when the save commits or fails."""
        self._commit.add_done_callback(lambda _f: fn(self))


@dataclass(frozen=True, eq=False)
class Deferred:
    """A tensor produced only when the writer reaches it, and dropped once it is written.

    For data that is not in memory (optimizer state on a disk tier): ``produce()`` runs on the writer
    thread and must return a CPU tensor of ``dtype`` and ``shape``. At most ``max_inflight`` deferred
    tensors exist at once, so a checkpoint of data larger than RAM needs only a few buffers.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
