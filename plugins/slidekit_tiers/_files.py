"""What the file-backed tiers (``posix``, ``gds``) share: the offload directory, region files, futures.

A file-backed tier keeps each region in a file of its own, inside a private
subdirectory ``slidekit-<tier>-<pid>-XXXX`` of ``TierContext.directory``, which
names its owner (``slidekit.owned``: an ``.owner`` file the tier holds an flock
on while it lives).
Files are rounded up to ``ALIGN`` bytes (the page size and the largest
logical block size O_DIRECT and GPUDirect Storage ask for) and reserved up
front with ``posix_fallocate``, so a full disk fails at ``allocate`` with the
bytes needed and the bytes free instead of halfway through training. Files go
when their region is freed, when the tier closes, when it is garbage
collected, and at interpreter exit (a ``weakref.finalize``, which also runs at
exit); a ``kill -9`` leaves the subdirectory behind, and the next run's start
removes it (``slidekit.owned.reclaim``: the lock of a dead owner is free), while
a live run's subdirectory, whose lock is held, is never touched.

A region freed while I/O on it is still in flight is closed and unlinked
when the last of that I/O completes, so a descriptor is never closed (and
then reused by another ``open``) under a running ``pread``.

Test: ``pytest tests/plugins/test_posix_tier.py`` (these helpers run under both tiers' tests).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

import torch

from slidekit.errors import ConfigError
from slidekit.interfaces import TierStats
from slidekit.owned import OwnedDir
from slidekit.tierkit import Counters, IoPool, byte_view, caller_ready

__all__ = [
    "ALIGN",
    "FileTier",
    "Join",
    "Region",
    "RegionFiles",
    "disk_free",
    "round_up",
]

#: File sizes, O_DIRECT offsets, lengths and buffer addresses are multiples of this.
ALIGN = 4096

_FIX_DIR = "set engine.offload_dir (CLI: --offload-dir) to a writable directory on a fast local disk"


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def disk_free(path: str) -> int | None:
    """Bytes free on the file system holding ``path`` for this user; None if it cannot be read."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _make_root(directory: str | None, tier: str) -> OwnedDir:
    """Check the offload directory and create this tier's private subdirectory in it."""
    if directory is None:
        raise ConfigError(
            f"the {tier} tier keeps its regions in files and was given no directory: {_FIX_DIR}"
        )
    if not os.path.exists(directory):
        raise ConfigError(
            f"the {tier} tier's directory {directory!r} does not exist: create it (mkdir -p) or {_FIX_DIR}"
        )
    if not os.path.isdir(directory):
        raise ConfigError(f"the {tier} tier's directory {directory!r} is not a directory: {_FIX_DIR}")
    try:
        return OwnedDir.create(directory, f"slidekit-{tier}-")
    except OSError as e:
        raise ConfigError(
            f"the {tier} tier cannot create files in {directory!r} ({e.strerror}): "
            f"make it writable for this user or {_FIX_DIR}"
        ) from e


def _no_space(tier: str, key: str, root: str, need: int, free: int | None) -> OSError:
    have = "an unknown number of bytes" if free is None else f"{free} bytes ({_human(free)})"
    return OSError(
        errno.ENOSPC,
        f"the {tier} tier needs {need} bytes ({_human(need)}) on disk for region {key!r} in {root}, "
        f"but the file system has {have} free: free disk space, point engine.offload_dir "
        "(--offload-dir) at a larger disk, or offload less",
    )


def _reserve(fd: int, need: int, *, tier: str, key: str, root: str) -> bool:
    """Reserve ``need`` bytes for an open file; False if the file system cannot reserve (sparse file)."""
    free = disk_free(root)
    if free is not None and need > free:
        raise _no_space(tier, key, root, need, free)
    if need == 0:
        return True
    try:
        os.posix_fallocate(fd, 0, need)
        return True
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_space(tier, key, root, need, disk_free(root)) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL):
            raise
    os.ftruncate(fd, need)  # no fallocate here: the size is right, the space is not held
    return False


@dataclass(eq=False)
class Region:
    """One region: its file and the handle the tier reads and writes it through."""

    key: str
    path: str
    nbytes: int  # the size asked for; transfers must stay inside it
    disk_bytes: int  # the file's size: nbytes rounded up to ALIGN
    handle: Any  # an fd (posix) or a kvikio CuFile (gds)
    lock: threading.Lock = field(default_factory=threading.Lock)  # serialises partial-block rewrites
    pending: int = 0  # transfers in flight
    freed: bool = False


def _discard(region: Region, close_file: Callable[[Any], None]) -> None:
    try:
        close_file(region.handle)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(region.path)


def _remove_all(
    regions: dict[str, Region], lock: threading.Lock, owned: OwnedDir, close_file: Callable[[Any], None]
) -> None:
    with lock:
        doomed = list(regions.values())
        regions.clear()
    for region in doomed:
        with contextlib.suppress(Exception):  # cleanup at exit or GC must not raise; rmtree still runs
            _discard(region, close_file)
    shutil.rmtree(owned.path, ignore_errors=True)
    owned.release()  # after the files are gone: a locked directory is never mistaken for a leftover


class RegionFiles:
    """The region files of one tier, in a private subdirectory that goes away with the tier."""

    def __init__(
        self,
        directory: str | None,
        *,
        tier: str,
        close_file: Callable[[Any], None],
    ) -> None:
        self.tier = tier
        self._owned = _make_root(directory, tier)
        self.root = self._owned.path
        self.reserved = True  # False once a file system could not reserve space up front
        self._close = close_file
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        self._seq = 0
        # Runs on close(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(
            self, _remove_all, self._regions, self._lock, self._owned, close_file
        )

    def allocate(self, key: str, nbytes: int, open_file: Callable[[str], Any]) -> None:
        """Create, reserve and open (``open_file(path) -> handle``) the file of a new region."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"region {key!r}: size must be an int >= 0 bytes, got {nbytes!r}")
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError(f"the {self.tier} tier is closed; build a new one")
            if key in self._regions:
                raise KeyError(f"region {key!r} already exists in the {self.tier} tier; free it first")
            self._seq += 1
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:80]
            path = os.path.join(self.root, f"{self._seq:06d}-{safe}.bin")
            disk = round_up(nbytes)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                try:
                    self.reserved &= _reserve(fd, disk, tier=self.tier, key=key, root=self.root)
                finally:
                    os.close(fd)
                handle = open_file(path)
            except BaseException:
                os.unlink(path)
                raise
            self._regions[key] = Region(key=key, path=path, nbytes=nbytes, disk_bytes=disk, handle=handle)

    def acquire(self, key: str, offset: int, nbytes: int) -> Region:
        """The region for a transfer of ``nbytes`` at ``offset``, held open until ``release``."""
        with self._lock:
            region = self._regions.get(key)
            if region is None:
                raise KeyError(f"no region {key!r} in the {self.tier} tier; allocate it first")
            if not isinstance(offset, int) or offset < 0 or offset + nbytes > region.nbytes:
                raise ValueError(
                    f"region {key!r} holds {region.nbytes} bytes; cannot move {nbytes} bytes at offset "
                    f"{offset!r} (offsets are >= 0 and offset + length <= the region's size)"
                )
            region.pending += 1
            return region

    def release(self, region: Region) -> None:
        with self._lock:
            region.pending -= 1
            last = region.freed and region.pending == 0
        if last:
            _discard(region, self._close)

    def free(self, key: str) -> None:
        with self._lock:
            region = self._regions.pop(key, None)
            if region is None:
                return
            region.freed = True
            now = region.pending == 0
        if now:
            _discard(region, self._close)

    def disk_bytes(self) -> int:
        with self._lock:
            return sum(r.disk_bytes for r in self._regions.values())

    def close(self) -> None:
        self._finalizer()


class Join:
    """One future for a transfer split into parts: done when every part is, failed if any part failed.

    It completes only after the last part has finished, even when an earlier
    part failed, so the caller never gets a tensor back while a worker still
    writes into it. ``finish(ok)`` runs first (count bytes, release the region).
    """

    def __init__(self, parts: int, finish: Callable[[bool], None]) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()  # a transfer in flight cannot be cancelled
        self._left = parts
        self._error: BaseException | None = None
        self._finish = finish
        self._lock = threading.Lock()
        if parts == 0:
            self._complete()

    def part_done(self, part: Future[Any]) -> None:
        error = CancelledError("the tier closed before this transfer ran") if part.cancelled() else None
        error = error or part.exception()
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        try:
            self._finish(self._error is None)
        except BaseException as e:
            self._error = self._error or e
        if self._error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(self._error)


class FileTier:
    """The surface the file-backed tiers share: regions, futures, counters, stats and closing.

    A subclass calls ``_start_files`` from its constructor and supplies ``_open``
    (how a region file is opened), ``_jobs`` (the blocking pieces of one
    transfer, run on the tier's thread pool) and ``detail``. Byte views,
    counters, the caller's-stream event and the pool are ``slidekit.tierkit``'s.
    """

    name: str

    def _start_files(self, files: RegionFiles, threads: int, close_timeout_s: float) -> None:
        self._files = files
        self._pool = IoPool(threads, tier=self.name, timeout_s=close_timeout_s)
        self._threads = self._pool.threads
        self._counters = Counters()
        self._closed = False

    def _open(self, path: str) -> Any:
        raise NotImplementedError

    def _jobs(
        self, key: str, region: Region, data: torch.Tensor, offset: int, write: bool, ready: Any
    ) -> list[Callable[[], None]]:
        """The pieces of one transfer of ``data`` (flat uint8) at ``offset``; each runs on the pool."""
        raise NotImplementedError

    @property
    def detail(self) -> str:
        raise NotImplementedError

    @property
    def root(self) -> str:
        """The private directory holding this tier's files."""
        return self._files.root

    # ---------------------------------------------------------------- regions

    def allocate(self, key: str, nbytes: int) -> None:
        self._check_open()
        self._files.allocate(key, nbytes, self._open)

    def map(self, key: str) -> torch.Tensor | None:
        return None  # file regions are not addressable; every access goes through read/write

    def free(self, key: str) -> None:
        self._files.free(key)

    # ---------------------------------------------------------------- I/O

    def write(self, key: str, src: torch.Tensor, offset: int = 0) -> Future[None]:
        return self._transfer(key, src, offset, write=True)

    def read(self, key: str, dst: torch.Tensor, offset: int = 0) -> Future[None]:
        return self._transfer(key, dst, offset, write=False)

    def _transfer(self, key: str, t: torch.Tensor, offset: int, *, write: bool) -> Future[None]:
        self._check_open()
        data = byte_view(t)  # (n,) uint8, host or CUDA
        n = data.numel()
        region = self._files.acquire(key, offset, n)
        # Everything queued on the caller's stream so far (producing src, or still using dst)
        # happens before the tier touches the tensor (None for a host tensor).
        ready = caller_ready(data)

        def finish(ok: bool) -> None:
            self._files.release(region)
            if ok:
                self._counters.add(written=n if write else 0, read=0 if write else n)

        jobs = self._jobs(key, region, data, offset, write, ready)
        join = Join(len(jobs), finish)
        for job in jobs:
            self._pool.submit(job).add_done_callback(join.part_done)
        return join.future

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} tier is closed; build a new one")

    # ---------------------------------------------------------------- reporting and closing

    def stats(self) -> TierStats:
        return self._counters.stats(
            allocated=self._files.disk_bytes(),
            capacity=None if self._closed else disk_free(self.root),
            detail=self.detail,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._pool.close():  # I/O is stuck (warned): its files and buffers stay until exit
            return
        self._files.close()
        self._close_more()

    def _close_more(self) -> None:
        """What a subclass releases after its files (buffers)."""
