"""The ``posix`` storage tier: regions in preallocated files, moved with positional, aligned I/O.

Each region is a file in a private subdirectory of ``TierContext.directory``
(``engine.offload_dir``), reserved up front, so a full disk fails at
``allocate`` (see ``_files.py``). Transfers are split into chunks (16 MiB by
default) that the tier's ``io_threads`` workers move with ``os.pwrite`` /
``os.preadv`` at explicit file offsets; chunks of one transfer run in
parallel, and the returned future completes when the last one has.

O_DIRECT. Where the file system allows it (probed once per directory: open a
file with O_DIRECT and move one aligned block through it) the files bypass the
page cache, so spilling 100 GB of optimizer state does not evict the host
memory the run needs. O_DIRECT wants buffer addresses, file offsets and
lengths aligned to the block size; the tier aligns everything to 4096 bytes:

* a chunk covers a 4096-aligned file range; bytes pass through a page-aligned
  bounce buffer (one per worker thread, page-locked when CUDA is present);
* a host tensor whose bytes are aligned and cover whole blocks is read or
  written in place, with no bounce copy;
* a write that covers a block only in part reads the block first and writes
  it back whole (read-modify-write), under a per-region lock, so concurrent
  writes to neighbouring byte ranges never lose each other's bytes.

Where O_DIRECT is refused (tmpfs on older kernels, some network and FUSE file
systems) the tier falls back to buffered I/O, straight from and into host
tensors; ``stats().detail`` says which it runs and why.

CUDA tensors move through the bounce buffers: a write first copies a chunk
device-to-host on a side stream that waits on an event recorded on the
caller's current stream when ``write`` was called (so the source is complete),
then writes it to the file; a read fills the bounce buffer from the file, then
copies host-to-device the same way (so kernels queued before the call that
still use the destination finish first). Futures complete after the copies
have synchronised.

Settings (``plugins.options.posix``, CLI ``--plugin-option posix.KEY=VALUE``;
declared in the descriptor, so the core refuses any other key; docs/plugins.md):

``direct``
    "auto" (the default: O_DIRECT where the probe says the file system takes
    it, buffered I/O otherwise), true (require O_DIRECT: refused, with the
    probe's reason, where it cannot be had) or false (buffered I/O: the page
    cache holds what was written, which costs host memory the run needs).
``chunk_bytes``
    the most bytes one ``pwrite``/``preadv`` moves, and each worker's bounce
    buffer: a positive multiple of 4096 (default 16 MiB).
``io_threads``
    the workers moving chunks, 1 to 64 (default ``TierContext.io_threads``,
    2): more keep more requests in flight, which a striped or many-queue NVMe
    array needs to reach its bandwidth. Each holds one bounce buffer
    (``io_threads`` x ``chunk_bytes`` of pinned host memory on a GPU machine).

Test: ``pytest tests/plugins/test_posix_tier.py``; bandwidth:
``python benchmarks/tier_bandwidth.py --dir DIR``.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from slidekit.errors import ConfigError
from slidekit.hookspecs import hookimpl
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import Availability, TierContext, TierDescriptor
from slidekit.tierkit import StreamCopier
from slidekit_tiers._files import ALIGN, FileTier, Region, RegionFiles, round_up

__all__ = ["OPTIONS", "PosixTier", "chunk_spans", "direct_io_support", "probe_direct_io"]

DEFAULT_CHUNK = 16 << 20
MAX_THREADS = 64
#: The settings the tier takes (``TierDescriptor.options``): name -> what it does and its default.
OPTIONS = {
    "direct": '"auto" (default): O_DIRECT where the file system takes it; true: require it; false: buffered',
    "chunk_bytes": f"bytes per pwrite/preadv and per worker's bounce buffer, a multiple of {ALIGN} (16 MiB)",
    "io_threads": f"I/O worker threads, 1 to {MAX_THREADS} (default 2): more requests in flight",
}
_probes: dict[str, tuple[bool, str]] = {}
_probes_lock = threading.Lock()


def _available() -> Availability:
    if not all(hasattr(os, f) for f in ("pwrite", "preadv", "posix_fallocate")):
        return False, "needs POSIX positional I/O (os.pwrite, os.preadv, os.posix_fallocate): use Linux"
    return True, (
        "preallocated files in engine.offload_dir; O_DIRECT where the file system allows it, "
        "buffered I/O otherwise (stats().detail says which)"
    )


# --------------------------------------------------------------------------- raw I/O


def _pwrite_all(fd: int, buf: memoryview, pos: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], pos + done)


def _pread_all(fd: int, buf: memoryview, pos: int) -> None:
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], pos + done)
        if got == 0:
            raise OSError(f"region file ended at byte {pos + done}, expected {pos + len(buf)}")
        done += got


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())  # t: (n,) uint8 on the host; no copy


def probe_direct_io(directory: str) -> tuple[bool, str]:
    """Whether files in ``directory`` take O_DIRECT: open one so and move one aligned block through it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False, "this platform has no O_DIRECT"
    fd, path = tempfile.mkstemp(prefix=".slidekit-direct-probe-", dir=directory)
    os.close(fd)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | flag)
        except OSError as e:
            return False, f"the file system refuses O_DIRECT ({e.strerror})"
        out, back = mmap.mmap(-1, ALIGN), mmap.mmap(-1, ALIGN)  # anonymous maps are page-aligned
        try:
            out.write(bytes(range(256)) * (ALIGN // 256))
            with memoryview(out) as src, memoryview(back) as dst:
                _pwrite_all(fd, src, 0)
                _pread_all(fd, dst, 0)
            if out[:] != back[:]:
                return False, "O_DIRECT read back other bytes than it wrote"
        except OSError as e:
            return False, f"O_DIRECT I/O fails on this file system ({e.strerror})"
        finally:
            os.close(fd)
            out.close()
            back.close()
    finally:
        os.unlink(path)
    return True, "O_DIRECT"


def direct_io_support(directory: str, *, fresh: bool = False) -> tuple[bool, str]:
    """``probe_direct_io`` once per directory (``fresh`` probes again and remembers the new answer)."""
    key = os.path.realpath(directory)
    with _probes_lock:
        if fresh or key not in _probes:
            _probes[key] = probe_direct_io(directory)
        return _probes[key]


def chunk_spans(offset: int, nbytes: int, align: int, chunk: int) -> list[tuple[int, int]]:
    """File ranges ``[start, stop)`` a transfer of ``nbytes`` at ``offset`` moves, widened to ``align``.

    Every range starts and stops on a multiple of ``align`` (``chunk`` is one)
    and holds at most ``chunk`` bytes; together they cover the transfer.
    """
    if nbytes == 0:
        return []
    start = offset // align * align
    stop = round_up(offset + nbytes, align)
    return [(s, min(s + chunk, stop)) for s in range(start, stop, chunk)]


def _bad(key: str, value: Any, want: str) -> ConfigError:
    return ConfigError(
        f"posix tier: plugins.options.posix.{key} must be {want}, got {value!r} "
        f"(CLI: --plugin-option posix.{key}=VALUE; leave it out for the default)"
    )


def _parse_options(options: Mapping[str, Any], threads: int) -> tuple[int, bool | None, int]:
    """(chunk_bytes, direct: None for "auto", io_threads) from the tier's settings; ``threads`` is the
    default worker count (``TierContext.io_threads``)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"posix tier: unknown options {unknown}; valid: {', '.join(sorted(OPTIONS))}")
    chunk = options.get("chunk_bytes", DEFAULT_CHUNK)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0 or chunk % ALIGN:
        raise _bad("chunk_bytes", chunk, f"a positive multiple of {ALIGN}, such as {DEFAULT_CHUNK} (16 MiB)")
    direct = options.get("direct", "auto")
    if direct != "auto" and not isinstance(direct, bool):
        raise _bad("direct", direct, "'auto', true or false")
    workers = options.get("io_threads", threads)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_THREADS:
        raise _bad("io_threads", workers, f"an integer from 1 to {MAX_THREADS}")
    return chunk, None if direct == "auto" else direct, workers


# --------------------------------------------------------------------------- the tier


class PosixTier(FileTier):
    """Named byte regions in preallocated files, moved by a thread pool with positional I/O."""

    name = "posix"

    def __init__(self, ctx: TierContext) -> None:
        self.chunk, want_direct, threads = _parse_options(ctx.options, ctx.io_threads)
        files = RegionFiles(ctx.directory, tier="posix", close_file=os.close)
        try:
            self.direct, self.direct_reason = self._choose_direct(ctx.directory, want_direct)
        except BaseException:
            files.close()
            raise
        self._align = ALIGN if self.direct else 1
        self._host = HostBuffers(pin=torch.cuda.is_available())
        self._local = threading.local()  # per worker: its bounce buffer
        self._copier = StreamCopier()  # per worker: its CUDA side stream
        self._start_files(files, threads, ctx.close_timeout_s)

    def _choose_direct(self, directory: str | None, want: bool | None) -> tuple[bool, str]:
        if want is False:
            return False, "O_DIRECT switched off (plugins.options.posix.direct is false)"
        assert directory is not None  # RegionFiles checked it
        ok, why = direct_io_support(directory)
        if want and not ok:
            raise ConfigError(
                f"posix tier: plugins.options.posix.direct is true but {directory!r} cannot do O_DIRECT: "
                f"{why}; leave direct at 'auto' to fall back to buffered I/O, or use another directory"
            )
        return ok, why

    def _open(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        return os.open(path, flags)

    def _jobs(
        self, key: str, region: Region, data: torch.Tensor, offset: int, write: bool, ready: Any
    ) -> list[Callable[[], None]]:
        spans = chunk_spans(offset, data.numel(), self._align, self.chunk)
        return [functools.partial(self._move, region, data, offset, span, write, ready) for span in spans]

    def _move(
        self,
        region: Region,
        data: torch.Tensor,  # (n,) uint8: the caller's bytes, host or CUDA
        offset: int,
        span: tuple[int, int],
        write: bool,
        ready: Any,
    ) -> None:
        """Move one chunk: file range ``span`` (aligned), of which the caller's bytes are ``[lo, hi)``."""
        start, stop = span
        lo, hi = max(start, offset), min(stop, offset + data.numel())
        piece = data[lo - offset : hi - offset]
        fd = region.handle
        whole = lo == start and hi == stop
        if piece.device.type == "cpu" and whole and piece.data_ptr() % self._align == 0:
            (_pwrite_all if write else _pread_all)(fd, _mv(piece), lo)  # in place, no bounce copy
            return
        buf = self._bounce()[: stop - start]
        inner = buf[lo - start : hi - start]
        if not write:
            _pread_all(fd, _mv(buf), start)
            self._copier.copy(piece, inner, ready)  # synchronised: the bounce buffer is reused next
            return
        with contextlib.nullcontext() if whole else region.lock:
            if not whole:
                self._read_edges(fd, buf, start, stop, lo, hi)
            self._copier.copy(inner, piece, ready)
            _pwrite_all(fd, _mv(buf), start)

    def _read_edges(self, fd: int, buf: torch.Tensor, start: int, stop: int, lo: int, hi: int) -> None:
        """Fill the blocks a write covers only in part with their bytes on disk."""
        a = self._align
        if lo > start:
            _pread_all(fd, _mv(buf[:a]), start)
        if hi < stop and not (lo > start and stop - a == start):
            _pread_all(fd, _mv(buf[stop - a - start : stop - start]), stop - a)

    def _bounce(self) -> torch.Tensor:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            if self._host.pin:
                buf = self._host.empty(self.chunk, torch.uint8)  # page-locked, starts on a page
            else:
                raw = torch.empty(self.chunk + ALIGN, dtype=torch.uint8)
                start = (-raw.data_ptr()) % ALIGN
                buf = raw[start : start + self.chunk]
            assert buf.data_ptr() % ALIGN == 0
            self._local.bounce = buf
        return buf

    # ---------------------------------------------------------------- reporting

    @property
    def detail(self) -> str:
        if self.direct:
            size = f"{self.chunk >> 20} MiB" if self.chunk % (1 << 20) == 0 else f"{self.chunk >> 10} KiB"
            how = f"O_DIRECT, {size} chunks through page-aligned bounce buffers"
        else:
            how = f"buffered I/O ({self.direct_reason})"
        reserve = "" if self._files.reserved else "; space not reserved up front (no fallocate here)"
        return f"files in {self.root}; {how}; {self._threads} I/O threads{reserve}"

    def _close_more(self) -> None:
        self._host.close()


@hookimpl
def slidekit_storage_tiers() -> Iterator[TierDescriptor]:
    yield TierDescriptor(
        name="posix",
        medium="disk",
        factory=PosixTier,
        available=_available,
        priority=10,
        description="preallocated files in engine.offload_dir (O_DIRECT where possible)",
        options=OPTIONS,
    )
