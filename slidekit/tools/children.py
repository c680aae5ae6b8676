"""Child processes that print JSON records: run one with a time limit, keep every record it printed.

``slidekit bench`` runs each measurement in its own process (peak memory is a
property of a process) and reads the JSON lines they print. ``stream_child``
runs one command in its own process group, hands each record (a JSON object
with a ``status`` key, on a line of its own) to a callback as soon as it is
printed, kills the whole group at its deadline and keeps what was printed
before a kill or a crash. ``run_child`` is the one-record form.

Test: ``pytest tests/test_bench.py`` (its child-process tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ChildRun", "last_error", "run_child", "stream_child"]


def _parse_record(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "status" in record else None


def last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return ((errors or lines or ["no output"])[-1])[:400]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildRun:
    """What one child process left behind."""

    records: list[dict[str, Any]]  # every JSON record it printed, in order (also before a kill or crash)
    returncode: int | None  # None when it was killed at its timeout
    timeout: float  # the seconds it was given
    stderr: str
    wall_s: float

    @property
    def failure(self) -> str | None:
        """Why it did not finish cleanly (a timeout, or an exit code and its last error line), or None."""
        if self.returncode is None:
            return f"timed out after {self.timeout:.0f} s (raise --timeout or --time-budget)"
        if self.returncode != 0:
            return f"exit code {self.returncode}: {last_error(self.stderr)}"
        return None


def stream_child(
    cmd: Sequence[str],
    *,
    timeout: float,
    log: Path | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> ChildRun:
    """Run ``cmd`` in its own process group; each JSON record it prints goes to ``on_record`` at once.

    A run past ``timeout`` seconds is killed with everything it started; the records it printed
    before are kept. Two threads drain stdout and stderr, so neither pipe can fill up and stall it.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: queue.Queue[str | None] = queue.Queue()  # stdout lines; None at its end
    err: list[str] = []
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, lines.put, True), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, err.append, False), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    out: list[str] = []
    records: list[dict[str, Any]] = []

    def take(line: str) -> None:
        out.append(line)
        record = _parse_record(line)
        if record is not None:
            records.append(record)
            if on_record is not None:
                on_record(record)

    deadline = t0 + timeout
    killed = False
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            killed = True
            break
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            killed = True
            break
        if line is None:
            break
        take(line)
    if not killed:  # stdout is closed; the process may still be finishing
        try:
            proc.wait(timeout=max(deadline - time.perf_counter(), 0.1))
        except subprocess.TimeoutExpired:
            killed = True
    if killed:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pump in pumps:
        pump.join(timeout=10)
    if not any(pump.is_alive() for pump in pumps):  # else a survivor outside the group holds a pipe
        proc.stdout.close()  # type: ignore[union-attr]  # both are pipes (PIPE above)
        proc.stderr.close()  # type: ignore[union-attr]
    while not lines.empty():  # what it printed just before the kill
        if (line := lines.get_nowait()) is not None:
            take(line)
    run = ChildRun(
        records=records,
        returncode=None if killed else proc.returncode,
        timeout=timeout,
        stderr="".join(err),
        wall_s=round(time.perf_counter() - t0, 1),
    )
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{''.join(out)}\n--- stderr\n{run.stderr}\n")
    return run


def _pump(stream: Any, put: Callable[[Any], None], mark_end: bool) -> None:
    for line in stream:
        put(line)
    if mark_end:
        put(None)


def run_child(cmd: Sequence[str], *, timeout: float, log: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` (a run printing one JSON line) in its own process group; its record, or why there is none.

    A run past ``timeout`` seconds is killed with everything it started.
    """
    run = stream_child(cmd, timeout=timeout, log=log)
    if run.returncode is not None and run.records:
        record = run.records[-1]
    else:
        reason = run.failure or f"exit code {run.returncode}: {last_error(run.stderr)}"
        record = {"status": "unavailable", "reason": reason}
    record["wall_s"] = run.wall_s
    return record
