"""The logger run of the fit on each thread: ``Trainer.fit`` calls every lifecycle hook on its own thread,
so two trainers fitting at once on two threads each keep their own run."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["PerThread"]

T = TypeVar("T")


class PerThread(Generic[T]):
    """One value per thread: ``put`` when a fit starts, ``get`` in its hooks, ``pop`` when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[int, T] = {}

    def put(self, value: T) -> T | None:
        """Keep ``value`` for this thread; the value it replaces (None normally), for the caller to close."""
        with self._lock:
            old = self._values.get(threading.get_ident())
            self._values[threading.get_ident()] = value
        return old

    def get(self) -> T | None:
        with self._lock:
            return self._values.get(threading.get_ident())

    def pop(self) -> T | None:
        with self._lock:
            return self._values.pop(threading.get_ident(), None)
