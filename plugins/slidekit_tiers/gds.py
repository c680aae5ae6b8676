"""The ``gds`` storage tier: region files moved by kvikio's CuFile, straight to and from GPU memory.

Regions are preallocated files in a private subdirectory of
``TierContext.directory``, exactly as in the ``posix`` tier (``_files.py``:
space reserved at ``allocate``, files removed on free, close, exit and GC),
with the same region and offset semantics. Each file is opened once as a
``kvikio.CuFile(path, "r+")``; a transfer is one ``CuFile.pwrite`` or
``CuFile.pread`` of the tensor's bytes at the region's file offset, which
kvikio splits into tasks for its own thread pool (size: ``KVIKIO_NTHREADS``).
CUDA tensors go in as they are (``__cuda_array_interface__``), host tensors as
numpy arrays.

How the bytes travel depends on the machine, and ``available()`` and
``stats().detail`` say which:

* "GPUDirect Storage": cuFile with the nvidia-fs driver DMAs between the NVMe
  drive and GPU memory, with no copy through host memory;
* "kvikio compatibility mode (no GDS driver)": kvikio (or cuFile itself, when
  nvidia-fs is not loaded) reads and writes with POSIX calls through host
  bounce buffers. Same bytes, less bandwidth.

kvikio needs the CUDA driver for any I/O, so without one (or without kvikio,
an optional dependency: ``pip install 'slidekit[gds]'``) the tier is
unavailable and says why; ``available()`` never raises.

Ordering: kvikio does not run on the caller's stream, so each transfer of a
CUDA tensor first waits (on a tier worker thread) for an event recorded on the
caller's current stream when ``write``/``read`` was called; the source is then
complete and the destination no longer in use. The future completes after
kvikio reports every byte moved. Writes that start or end inside a 4096-byte
block hold a per-region lock, so concurrent writes to neighbouring byte ranges
cannot race in a read-modify-write of a shared block.

Test: ``pytest tests/plugins/test_gds_tier.py`` (the conformance run needs kvikio and a GPU);
bandwidth: ``python benchmarks/tier_bandwidth.py --dir DIR``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slidekit.errors import ConfigError, DriverUnavailableError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, TierContext, TierDescriptor
from slidekit_tiers._files import ALIGN, FileTier, Region, RegionFiles

__all__ = ["COMPAT", "GDS", "NOT_INSTALLED", "GdsTier", "decide_availability"]

NOT_INSTALLED = "kvikio is not installed (pip install 'slidekit[gds]')"
GDS = "GPUDirect Storage"
COMPAT = "kvikio compatibility mode (no GDS driver)"


# --------------------------------------------------------------------------- availability


def decide_availability(
    installed: Callable[[], bool], cuda_problem: Callable[[], str | None], io_mode: Callable[[], str]
) -> Availability:
    """``(ok, reason)`` from the three probes, in order; a probe that raises makes it unavailable."""
    try:
        if not installed():
            return False, NOT_INSTALLED
        problem = cuda_problem()
        if problem is not None:
            return False, problem
        return True, io_mode()
    except Exception as e:
        return False, f"probing kvikio failed ({type(e).__name__}: {e})"


def _kvikio_installed() -> bool:
    return importlib.util.find_spec("kvikio") is not None


def _cuda_problem() -> str | None:
    if not sys.platform.startswith("linux"):
        return "no CUDA driver (kvikio runs on Linux only)"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 cannot be loaded)"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (torch.cuda.is_available() is False)"
    return None


def _kvikio() -> Any:
    kvikio = importlib.import_module("kvikio")
    importlib.import_module("kvikio.defaults")
    importlib.import_module("kvikio.cufile_driver")
    return kvikio


def _compat_preferred(kvikio: Any) -> bool:
    defaults = kvikio.defaults
    preferred = getattr(defaults, "is_compat_mode_preferred", None)
    if preferred is not None:  # kvikio >= 24.12; resolves AUTO to what kvikio will do
        return bool(preferred())
    mode = defaults.compat_mode()  # older: a bool, or a CompatMode
    return bool(getattr(mode, "name", "ON" if mode else "OFF") == "ON")


def _gds_driver_ready(kvikio: Any) -> bool:
    """cuFile's own verdict: is the nvidia-fs driver there, so I/O really goes GPU <-> NVMe?"""
    driver = kvikio.cufile_driver
    if hasattr(driver, "get"):  # kvikio >= 25.04
        return bool(driver.get("is_gds_available"))
    props = getattr(driver, "properties", None) or driver.DriverProperties()
    return bool(props.is_gds_available)


def _io_mode() -> str:
    kvikio = _kvikio()
    if _compat_preferred(kvikio):
        return COMPAT
    try:
        ready = _gds_driver_ready(kvikio)
    except Exception as e:  # kvikio will still do the I/O; only the verdict is unknown
        return f"{COMPAT}: cuFile is loaded but its driver properties cannot be read ({e})"
    if ready:
        return GDS
    return f"{COMPAT}: cuFile is loaded but the nvidia-fs driver is not, so cuFile does POSIX I/O"


@functools.cache
def _available() -> Availability:
    return decide_availability(_kvikio_installed, _cuda_problem, _io_mode)


def _kvikio_threads(kvikio: Any) -> str:
    with contextlib.suppress(Exception):
        defaults = kvikio.defaults
        if hasattr(defaults, "get"):
            return str(defaults.get("num_threads"))
        return str(defaults.get_num_threads())
    return "?"


def _close_cufile(handle: Any) -> None:
    handle.close()


# --------------------------------------------------------------------------- the tier


class GdsTier(FileTier):
    """Named byte regions in files, read and written by kvikio CuFile (GPUDirect Storage where present)."""

    name = "gds"

    def __init__(self, ctx: TierContext, *, kvikio: Any = None) -> None:
        """``kvikio``: a stand-in for the kvikio module (tests run the tier's logic on the CPU with one)."""
        ok, how = (True, "a kvikio stand-in") if kvikio is not None else _available()
        if not ok:
            raise DriverUnavailableError(
                f"the gds tier cannot run here: {how}; the posix tier keeps the same files "
                "through host bounce buffers"
            )
        if ctx.options:
            raise ConfigError(f"gds tier: unknown options {sorted(ctx.options)}; it takes none")
        self._kvikio = kvikio if kvikio is not None else _kvikio()
        self.mode = how
        files = RegionFiles(ctx.directory, tier="gds", close_file=_close_cufile)
        self._start_files(files, ctx.io_threads, ctx.close_timeout_s)

    def _open(self, path: str) -> Any:
        return self._kvikio.CuFile(path, "r+")

    def _jobs(
        self, key: str, region: Region, data: torch.Tensor, offset: int, write: bool, ready: Any
    ) -> list[Callable[[], None]]:
        n = data.numel()
        shares_block = bool(offset % ALIGN or (offset + n) % ALIGN)

        def run() -> None:
            if n == 0:
                return
            if ready is not None:
                ready.synchronize()  # kvikio works outside the caller's stream: wait for it here
            buf = data if data.device.type == "cuda" else data.numpy()
            with region.lock if write and shares_block else contextlib.nullcontext():
                move = region.handle.pwrite if write else region.handle.pread
                io = move(buf, size=n, file_offset=offset)  # an IOFuture; kvikio's pool does the work
                moved = io.get()
            if moved != n:
                raise OSError(errno.EIO, f"kvikio moved {moved} of {n} bytes of region {key!r}")

        return [run]

    # ---------------------------------------------------------------- reporting

    @property
    def detail(self) -> str:
        version = getattr(self._kvikio, "__version__", "?")
        threads = _kvikio_threads(self._kvikio)
        return (
            f"{self.mode}; files in {self.root}; kvikio {version}, {threads} kvikio threads (KVIKIO_NTHREADS)"
        )


@hookimpl
def slidekit_storage_tiers() -> Iterator[TierDescriptor]:
    yield TierDescriptor(
        name="gds",
        medium="disk",
        factory=GdsTier,
        available=_available,
        priority=20,
        devices=("cuda",),
        description="files moved by kvikio CuFile (GPUDirect Storage, or kvikio's compatibility mode)",
    )
