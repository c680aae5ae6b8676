"""Child processes that print JSON records: run one with a time limit, keep every record it printed.

``slidekit bench`` runs each measurement in its own process (peak memory is a
property of a process) and reads the JSON lines they print. ``stream_child``
runs one command in its own process group, hands each record (a JSON object
with a ``status`` key, on a line of its own) to a callback as soon as it is
printed, kills the whole group at its deadline and keeps what was printed
before a kill or a crash. ``run_child`` is the one-record form.

A ``MemoryWatchdog`` makes running out of host RAM a measured result instead
of a dead machine: every ``poll_s`` it reads the child group's resident set
(every process of the group, from /proc) and ``MemAvailable``; once available
memory falls under its floor it kills the group and the run's ``failure`` says
"host RAM exhausted: child RSS X GiB, peak Y GiB (killed by the bench's memory
watchdog)". The child is also made the kernel OOM killer's first choice
(``oom_score_adj`` 1000), should memory go faster than the watchdog looks.

A child's *tree* is its process group and every descendant, also one that
started a session of its own: torchrun starts each rank with
``start_new_session``, so a kill of the group alone would leave the ranks
running, holding the GPUs and the output pipes. The kill, the watchdog's
RSS and its verdict all take the tree (``process_tree``), found from /proc
before anything is killed (a rank whose parent died is re-parented and
could no longer be found).

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

__all__ = [
    "ChildRun",
    "MemoryWatchdog",
    "group_rss_bytes",
    "kill_tree",
    "last_error",
    "process_tree",
    "run_child",
    "stream_child",
]

_GIB = float(2**30)


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
    killed_by: str | None = None  # the memory watchdog's reason, when it killed the run
    peak_rss_gib: float | None = None  # the largest resident set the watchdog saw (None: not watched)

    @property
    def failure(self) -> str | None:
        """Why it did not finish cleanly (host RAM exhausted, a timeout, or an exit code and its last
        error line), or None."""
        if self.killed_by is not None:
            return self.killed_by
        if self.returncode is None:
            return f"timed out after {self.timeout:.0f} s (raise --timeout or --time-budget)"
        if self.returncode != 0:
            return f"exit code {self.returncode}: {last_error(self.stderr)}"
        return None


def _status(pid: int) -> dict[str, int]:
    from slidekit.telemetry import proc_sizes

    return proc_sizes(f"/proc/{pid}/status")


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process /proc shows (empty where there is no /proc)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[1]), int(fields[2]))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def process_tree(root: int) -> list[int]:
    """``root``'s process group and every descendant of any of them (new sessions included), from /proc.

    torchrun's ranks run in sessions of their own, children of the agent: the group alone misses them.
    """
    table = _processes()
    found = {pid for pid, (_, group) in table.items() if group == root or pid == root}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def kill_tree(root: int) -> None:
    """SIGKILL ``root``'s tree (``process_tree``): its group, every descendant, and the groups that
    descendants lead (a rank's own children). Found before the first kill, so re-parenting loses none."""
    tree = process_tree(root)
    groups = {root} | {pid for pid in tree if _leads_group(pid)}
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def group_rss_bytes(pgid: int) -> tuple[int, int]:
    """(resident bytes now, the largest VmHWM) summed / taken over every process of ``pgid``'s tree.

    The tree (``process_tree``) is the group and every descendant, so a compiler or worker the child
    started counts too, and so do torchrun's ranks in sessions of their own; (0, 0) where there is no /proc.
    """
    rss = hwm = 0
    for pid in process_tree(pgid):
        status = _status(pid)
        rss += status.get("VmRSS", 0)
        hwm = max(hwm, status.get("VmHWM", 0))
    return rss, hwm


def mem_available_bytes(_group_rss: int = 0) -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is none); the argument is the watched group's
    RSS, which a stand-in for tests may use."""
    from slidekit.telemetry import proc_sizes

    return proc_sizes("/proc/meminfo").get("MemAvailable")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryWatchdog:
    """Kills a child's process group when host RAM runs out, and says so with the child's memory.

    ``available(group_rss)`` gives the bytes still available (``MemAvailable``; tests pass a stand-in
    computed from the child's own RSS, so a small child can "exhaust" a fake machine deterministically).
    """

    floor_bytes: int = 3 * 2**30  # kill once available memory falls under this
    poll_s: float = 0.5  # seconds between two looks
    available: Callable[[int], int | None] = mem_available_bytes
    settle_bytes: int | None = None  # what ``settle`` waits for before a child starts (None: twice the floor)

    def __post_init__(self) -> None:
        if self.floor_bytes < 0 or not self.poll_s > 0:
            raise ValueError(
                f"MemoryWatchdog needs floor_bytes >= 0 and poll_s > 0, got {self.floor_bytes}, {self.poll_s}"
            )

    def verdict(self, rss: int, peak: int, available: int | None) -> str | None:
        """The kill reason when ``available`` bytes are under the floor, else None."""
        if available is None or available >= self.floor_bytes:
            return None
        return (
            f"host RAM exhausted: child RSS {rss / _GIB:.1f} GiB, peak {max(rss, peak) / _GIB:.1f} GiB "
            f"(killed by the bench's memory watchdog: {available / _GIB:.1f} GiB available, under its "
            f"{self.floor_bytes / _GIB:.1f} GiB floor)"
        )

    def settle(self, timeout_s: float = 60.0) -> int | None:
        """Wait until the available memory is back at ``settle_bytes``, ``timeout_s`` at most (after a
        killed child, the kernel takes a while to give its pinned pages back: the next child must not
        be blamed for them); the bytes available then (None where that cannot be read)."""
        want = self.settle_bytes if self.settle_bytes is not None else 2 * self.floor_bytes
        deadline = time.monotonic() + timeout_s
        while True:
            available = self.available(0)
            if available is None or available >= want or time.monotonic() >= deadline:
                return available
            time.sleep(min(self.poll_s, 1.0))

    def watch(self, proc: subprocess.Popen[str]) -> _Watch:
        """Watch ``proc``'s process group from a thread until ``_Watch.stop`` (or until it kills it)."""
        with contextlib.suppress(OSError):  # the kernel's OOM killer takes this one first
            Path(f"/proc/{proc.pid}/oom_score_adj").write_text("1000")
        watch = _Watch()

        def run() -> None:
            while not watch.stopping.is_set():
                rss, hwm = group_rss_bytes(proc.pid)
                watch.peak = max(watch.peak, rss, hwm)
                why = self.verdict(rss, watch.peak, self.available(rss))
                if why is not None and proc.poll() is None:
                    watch.reason = why
                    kill_tree(proc.pid)
                    return
                watch.stopping.wait(self.poll_s)

        watch.thread = threading.Thread(target=run, name="bench-memory-watchdog", daemon=True)
        watch.thread.start()
        return watch


class _Watch:
    """One watched child: the kill reason (once there is one) and the peak group RSS seen, in bytes."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.peak = 0
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        """Stop watching; returns once the watching thread has ended (its last look included)."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()


def stream_child(
    cmd: Sequence[str],
    *,
    timeout: float,
    log: Path | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    watchdog: MemoryWatchdog | None = None,
    env: dict[str, str] | None = None,
) -> ChildRun:
    """Run ``cmd`` in its own process group; each JSON record it prints goes to ``on_record`` at once.

    A run past ``timeout`` seconds is killed with everything it started; the records it printed
    before are kept. Two threads drain stdout and stderr, so neither pipe can fill up and stall it.
    With a ``watchdog`` the group is also killed when host RAM runs out (``ChildRun.killed_by``).
    ``env``: variables added to this process's environment for the child.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
    )
    watch = watchdog.watch(proc) if watchdog else None
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
    if watch is not None:
        watch.stop()  # before a timeout's kill: a group killed for its time is not blamed on memory
    if killed:
        kill_tree(proc.pid)
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
        killed_by=watch.reason if watch else None,
        peak_rss_gib=round(watch.peak / _GIB, 3) if watch else None,
    )
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{''.join(out)}\n--- stderr\n{run.stderr}\n")
    return run


def _pump(stream: Any, put: Callable[[Any], None], mark_end: bool) -> None:
    for line in stream:
        put(line)
    if mark_end:
        put(None)


def run_child(
    cmd: Sequence[str], *, timeout: float, log: Path | None = None, watchdog: MemoryWatchdog | None = None
) -> dict[str, Any]:
    """Run ``cmd`` (a run printing one JSON line) in its own process group; its record, or why there is none.

    A run past ``timeout`` seconds (or out of host RAM, with a ``watchdog``) is killed with everything
    it started.
    """
    run = stream_child(cmd, timeout=timeout, log=log, watchdog=watchdog)
    if run.returncode is not None and run.records:
        record = run.records[-1]
    else:
        reason = run.failure or f"exit code {run.returncode}: {last_error(run.stderr)}"
        record = {"status": "unavailable", "reason": reason}
    record["wall_s"] = run.wall_s
    return record
