"""Building the fused CPU optimizer kernels (``csrc/*.cpp``): once per source, cached on disk, never hanging.

``layer_adam`` and ``adamw_8bit`` each have a C++ kernel, compiled on first use
with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed)
for the CPU capability torch dispatches to (AVX2, AVX512 flags), and cached in
the torch extensions directory (``TORCH_EXTENSIONS_DIR`` moves it) under
``slidekit/<name>``, where the name is the source's stem and a hash of the source, the headers
beside it (and in any ``include_dirs`` it is given), the flags, torch's and Python's versions: a
change to any of them builds anew.
A process builds or loads each source with its header directories at most
once (``load_kernel``); a failed build is remembered with its reason and not
retried in that process. The ninja probe and the hash of the source are taken
once per process too.

Every build runs under ``build_lock.exclusive_build``: an OS file lock beside
the build directory that dies with its holder. A build killed halfway (which
leaves torch's own ``lock`` file behind, on which every later torch build of
that directory would wait forever) is taken over: the stale file is removed
and the kernel built again. While another live process builds the same
kernel, the caller says so on stderr (the lock, the holder's pid) and waits
at most ``SLIDEKIT_BUILD_TIMEOUT`` seconds (default 300), then gives up with
an error naming the lock and the fix. Threads of one process wait on that file
lock too, each within its own bound: no process-wide lock is held while one
waits, so status checks and other kernels go on. A failed or abandoned build behaves as
any unavailable kernel: ``impl="auto"`` runs the pure-torch path with one
logged warning giving the reason, ``impl="cpp"`` raises ``KernelUnavailable``.

``slidekit build`` compiles every kernel ahead of time through each
optimizer descriptor's ``prepare`` (``prepare_kernel`` here), so no run ever
waits for a compiler.

Test: ``pytest tests/plugins/test_build_lock.py tests/plugins/test_layer_adam.py``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from slidekit.interfaces import Prepared
from slidekit_optim.build_lock import BuildLockTimeout, build_timeout, exclusive_build

__all__ = [
    "CSRC",
    "KERNEL_SOURCE",
    "KernelUnavailable",
    "kernel_status",
    "load_kernel",
    "load_or_fallback",
    "prepare_kernel",
]

#: The directory of the bundled kernel sources.
CSRC = Path(__file__).resolve().parent / "csrc"
#: ``layer_adam``'s kernel, what ``load_kernel()`` builds without an argument.
KERNEL_SOURCE = CSRC / "fused_adam.cpp"

# -ffp-contract=off: no multiply and add are ever fused, so the vector loop and its scalar remainder
# round alike. -fno-math-errno lets sqrt vectorize; -fno-trapping-math lets GCC if-convert. Neither
# changes a result. -fopenmp makes ATen's header-only parallel_for parallel; nothing links an OpenMP
# runtime, so its calls bind to the one torch loaded (torch's pool and thread count).
_CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
# Vector instruction sets per torch CPU capability (those ATen's own kernels for it assume).
_ISA_FLAGS = {
    "AVX2": ("-mavx2",),
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
}
_BUILD_SECONDS = 30  # one translation unit, about this long on one core of a recent x86 CPU


class KernelUnavailable(RuntimeError):
    """The fused C++ kernel cannot be built or loaded here; the message says why."""


@dataclass(frozen=True, slots=True)
class _BuildSpec:
    """Where and how one kernel source is built: one directory per source, flags and torch build."""

    source: Path
    name: str
    directory: Path
    flags: tuple[str, ...]
    capability: str
    include_dirs: tuple[Path, ...] = ()

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}{'.pyd' if sys.platform == 'win32' else '.so'}"


def _cpu_capability() -> str:
    return str(torch.backends.cpu.get_cpu_capability())


@functools.cache
def _ninja_available() -> bool:
    """Whether ninja runs here: probed once per process (torch starts ``ninja --version`` to tell)."""
    from torch.utils import cpp_extension

    return bool(cpp_extension.is_ninja_available())


def _missing_tool() -> str | None:
    """Why the kernel cannot be compiled here (no compiler, no ninja), or None."""
    cxx = os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension compiles with
    if shutil.which(cxx) is None:
        return f"no C++ compiler: {cxx!r} not found; install g++ or set CXX"
    if not _ninja_available():
        return "ninja not found; pip install ninja"
    return None


def _flags(capability: str) -> tuple[str, ...]:
    return _CFLAGS + _ISA_FLAGS.get(capability, ())


@functools.lru_cache(maxsize=32)
def _kernel_name(files: tuple[tuple[str, int, int], ...], capability: str, prefix: str) -> str:
    """The build's name: a hash of the source and headers (``files``: path, size, mtime, so an edit
    reads them anew), the flags, torch's and Python's versions. Read and hashed once per process."""
    text = b"\0".join(Path(f).read_bytes() for f, _size, _mtime in files)
    key = b"\0".join(
        [text, " ".join(_flags(capability)).encode(), torch.__version__.encode(), sys.version.encode()]
    )
    return f"{prefix}_{capability.lower()}_{hashlib.sha256(key).hexdigest()[:12]}"


def _build_spec(source: Path, *, include_dirs: tuple[Path, ...] = ()) -> _BuildSpec:
    """``include_dirs``: directories of headers the source includes besides its own (their headers
    join the hash). The build is named after the source's stem and that hash."""
    try:  # the source and the headers it may include by path: a change to any of them rebuilds
        headers = [h for d in (source.parent, *include_dirs) for h in sorted(d.glob("*.h"))]
        files = tuple((str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in [source, *headers])
        cap = _cpu_capability()
        name = _kernel_name(files, cap, f"slidekit_{source.stem}")
    except OSError as e:
        raise KernelUnavailable(f"cannot read the kernel source {source}: {e}") from e
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / "slidekit" / name
    flags = _flags(cap)
    return _BuildSpec(source, name, directory, flags, cap, include_dirs)


def _error_summary(err: BaseException) -> str:
    """The first compiler error line of a failed build (torch puts the whole log in the message)."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("FAILED")]
    picked = errors[1] if len(errors) > 1 and errors[0].startswith("Error building") else None
    text = picked or (errors[0] if errors else (lines[-1] if lines else type(err).__name__))
    return text if len(text) <= 300 else text[:297] + "..."


#: What one build is known by in a process: the resolved source and the header directories it was given
#: (one source built with other headers is another kernel, as ``_build_spec`` names it).
_Key = tuple[Path, tuple[Path, ...]]


def _build(key: _Key, timeout: float) -> ModuleType | str:
    """Build (or load the cached build of) the source with the header directories ``key`` names, under
    the build lock; the module, or why not."""
    source, include_dirs = key
    missing = _missing_tool()
    if missing:
        return missing
    try:
        spec = _build_spec(source, include_dirs=include_dirs)
    except KernelUnavailable as e:
        return str(e)
    from torch.utils import cpp_extension

    what = f"the fused CPU kernel {spec.name} ({source.name})"
    try:
        # The build lock is a file lock, which also keeps two threads of this process apart (each opens
        # it anew), each within its own timeout; no process-wide lock is held while one waits.
        with exclusive_build(spec.directory, what=what, timeout=timeout):
            done = _recorded(key)
            if isinstance(done, ModuleType):
                return done  # another thread of this process built it while this one waited
            if not spec.library.exists():
                print(
                    f"slidekit: building the fused CPU Adam kernel (first use, takes ~{_BUILD_SECONDS} s) "
                    f"in {spec.directory}...",
                    file=sys.stderr,
                    flush=True,
                )
            return cpp_extension.load(
                name=spec.name,
                sources=[str(source)],
                extra_cflags=list(spec.flags),
                extra_include_paths=[str(d) for d in spec.include_dirs],
                build_directory=str(spec.directory),
                verbose=False,
            )
    except BuildLockTimeout as e:  # its message names the lock, the holder and the fix
        return str(e)
    except Exception as e:  # a compiler error, a failed import, an unwritable cache: all mean "not here"
        return f"building {source.name} failed: {_error_summary(e)}"


_KERNELS: dict[_Key, ModuleType | str] = {}  # per build: the module, or why it cannot be built
_FELL_BACK: set[Path] = set()  # sources whose fallback to pure torch has been logged
_KERNELS_LOCK = threading.Lock()  # guards the two above, held only to read or write them


def _key(source: Path | str, include_dirs: tuple[Path | str, ...] = ()) -> _Key:
    return Path(source).resolve(), tuple(Path(d).resolve() for d in include_dirs)


def _recorded(key: _Key) -> ModuleType | str | None:
    with _KERNELS_LOCK:
        return _KERNELS.get(key)


def _record(key: _Key, outcome: ModuleType | str) -> None:
    """Remember a build's outcome: the first one, unless a module comes after a reason (a thread that
    waited longer built it after another gave up)."""
    with _KERNELS_LOCK:
        known = _KERNELS.get(key)
        if known is None or (isinstance(outcome, ModuleType) and not isinstance(known, ModuleType)):
            _KERNELS[key] = outcome


def load_kernel(
    source: Path | str = KERNEL_SOURCE,
    *,
    timeout: float | None = None,
    include_dirs: tuple[Path | str, ...] = (),
) -> ModuleType:
    """The fused kernel built from ``source``: built once per process (and cached on disk).

    ``timeout``: seconds to wait for another process (or thread) building the same kernel
    (None: ``SLIDEKIT_BUILD_TIMEOUT``, default 300). ``include_dirs``: header directories
    the source includes besides its own (a probe outside ``CSRC`` that includes the kernels'
    headers passes ``(CSRC,)``); their headers are part of the build's hash. Raises ``KernelUnavailable``
    with the reason when it cannot be built; the reason is remembered, so a
    failed build is tried once per process. ``ValueError`` for a malformed
    ``SLIDEKIT_BUILD_TIMEOUT``.
    """
    key = _key(source, include_dirs)
    limit = build_timeout() if timeout is None else timeout
    kernel = _recorded(key)
    if kernel is None:
        kernel = _build(key, limit)
        _record(key, kernel)
    if isinstance(kernel, str):
        raise KernelUnavailable(kernel)
    return kernel


def _log_fallback_once(source: Path, reason: str, owner: str) -> None:
    key = Path(source).resolve()
    with _KERNELS_LOCK:
        if key in _FELL_BACK:
            return
        _FELL_BACK.add(key)
    logging.getLogger(f"slidekit_optim.{owner}").warning(
        "slidekit: %s runs on pure torch ops, the fused CPU kernel is unavailable: %s", owner, reason
    )


def load_or_fallback(source: Path, requested: str, owner: str) -> ModuleType | None:
    """The fused kernel built from ``source``, or None where the torch path must serve.

    ``requested`` is the optimizer's ``impl``: "torch" never builds; "cpp"
    raises ``KernelUnavailable`` (naming ``owner``) when the kernel cannot be
    built; "auto" falls back to torch with one warning per source, logged by
    ``slidekit_optim.<owner>``.
    """
    if requested == "torch":
        return None
    try:
        return load_kernel(source)
    except KernelUnavailable as e:
        if requested == "cpp":
            raise KernelUnavailable(
                f"{owner}: impl='cpp' but the fused kernel is unavailable: {e}. "
                "Use impl='auto' (falls back to pure torch) or impl='torch'."
            ) from e
        _log_fallback_once(source, str(e), owner)
        return None


def kernel_status(source: Path = KERNEL_SOURCE) -> str:
    """Which path ``impl="auto"`` takes, and why, without compiling anything."""
    key = _key(source)
    kernel = _recorded(key)
    if isinstance(kernel, ModuleType):
        return "fused C++ kernel (loaded)"
    if isinstance(kernel, str):
        return f"pure torch ({kernel})"
    missing = _missing_tool()
    if missing:
        return f"pure torch ({missing})"
    try:
        spec = _build_spec(key[0])
    except KernelUnavailable as e:
        return f"pure torch ({e})"
    return "fused C++ kernel (" + ("built" if spec.library.exists() else "built on first use") + ")"


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def prepare_kernel(source: Path | str = KERNEL_SOURCE, *, timeout: float | None = None) -> Prepared:
    """Build the kernel from ``source`` now, or find its build up to date (an optimizer's ``prepare``).

    Raises ``KernelUnavailable`` with the reason when it cannot be built.
    """
    key = Path(source).resolve()
    missing = _missing_tool()
    if missing:
        raise KernelUnavailable(missing)
    spec = _build_spec(key)
    before = _mtime_ns(spec.library)
    load_kernel(key, timeout=timeout)
    return Prepared(
        built=_mtime_ns(spec.library) != before,  # ninja relinks only what is out of date
        location=str(spec.library),
        detail=f"fused C++ kernel from {key.name} for {spec.capability}",
    )
