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

Options (``TierContext.options``): ``chunk_bytes`` (a multiple of 4096;
default 16 MiB) and ``direct`` ("auto", True to require O_DIRECT, False for
buffered I/O).

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

__all__ = ["PosixTier", "chunk_spans", "direct_io_support", "probe_direct_io"]

DEFAULT_CHUNK = 16 << 20
_OPTIONS = ("chunk_bytes", "direct")
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


def _parse_options(options: Mapping[str, Any]) -> tuple[int, bool | None]:
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigError(f"posix tier: unknown options {unknown}; valid: {', '.join(_OPTIONS)}")
    chunk = options.get("chunk_bytes", DEFAULT_CHUNK)
    if not isinstance(chunk, int) or chunk <= 0 or chunk % ALIGN:
        raise ConfigError(f"posix tier: chunk_bytes must be a positive multiple of {ALIGN}, got {chunk!r}")
    direct = options.get("direct", "auto")
    if direct not in ("auto", True, False):
        raise ConfigError(f"posix tier: direct must be 'auto', True or False, got {direct!r}")
    return chunk, None if direct == "auto" else bool(direct)


# --------------------------------------------------------------------------- the tier


class PosixTier(FileTier):
    """Named byte regions in preallocated files, moved by a thread pool with positional I/O."""

    name = "posix"

    def __init__(self, ctx: TierContext) -> None:
        self.chunk, want_direct = _parse_options(ctx.options)
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
        self._start_files(files, ctx.io_threads, ctx.close_timeout_s)

    def _choose_direct(self, directory: str | None, want: bool | None) -> tuple[bool, str]:
        if want is False:
            return False, "O_DIRECT switched off (options['direct'] is False)"
        assert directory is not None  # RegionFiles checked it
        ok, why = direct_io_support(directory)
        if want and not ok:
            raise ConfigError(
                f"posix tier: options['direct'] is True but {directory!r} cannot do O_DIRECT: {why}; "
                "use direct='auto' to fall back to buffered I/O, or another directory"
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
    )
