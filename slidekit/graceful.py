"""A graceful stop: SIGINT, SIGTERM or SIGHUP during ``Trainer.fit`` ends the run after the current step."""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["GracefulStop"]


class GracefulStop:
    """SIGINT/SIGTERM/SIGHUP (the terminal closed) during ``fit``: finish the current step, then return
    (writing the checkpoint, with a run directory). A second signal aborts at once.

    Handlers are only installed from the main thread (Python delivers signals there).
    """

    SIGNALS = tuple(
        getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
    )  # no SIGHUP on Windows

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning the step")
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
