"""Checkpoint store: named tensors and metadata, written asynchronously and atomically, verified on load.

A fine-tune runs for days; this module makes sure a crash, a full disk or a damaged file never costs more
than the steps since the last good checkpoint.

On-disk format (version 1), one directory per checkpoint under a run's checkpoint directory::

    step-00001234/
      manifest.json          format + version, step, checksum algorithm, and per array: dtype, shape,
                             byte count, chunk shape, segment checksums and the array checksum;
                             plus meta.json's size and sha256, and a sha256 of the manifest itself
      meta.json              the caller's JSON metadata (step, schedule, data position, RNG states, config)
      arrays/<encoded name>/ one zarr v3 array per named tensor (tensorstore, driver "zarr3"):
        zarr.json            shape, data type (bfloat16 included), regular chunk grid, "bytes" codec
        c/<i>/<j>/...        one uncompressed file per chunk (little-endian raw elements)

Array names are free-form ("master/3", "state/3/exp_avg"); the directory name keeps ``[A-Za-z0-9_.-]``
and percent-encodes every other byte of the UTF-8 name ("master%2F3"), which is injective, so two names
never share a directory. Chunks split dimension 0 into blocks of about ``chunk_bytes`` (64 MiB), so
writes parallelise and a reader can fetch part of an array. Every chunk is stored, even an all-zero one,
so a missing chunk file is damage, not zeros. Checksums (sha256 by default, or xxh3-128 from ``xxhash``)
cover the raw little-endian bytes of the flattened tensor in segments of ``chunk_bytes`` bytes, hashed
in parallel; the array checksum is the segment digest when there is one segment (so it is the plain hash
of the raw bytes) and otherwise the hash of the concatenated binary segment digests. Float NaN payloads,
-0.0 and every integer bit pattern round-trip bitwise. The arrays are plain zarr v3: any zarr reader
opens them without slidekit.

Commit protocol (``CheckpointWriter.save``): everything is written into ``.tmp-step-00001234-<random>/``
beside the final directory; every file and directory in it is fsynced (chunk files by tensorstore's
``file_io_sync``, the rest here); it is renamed to ``step-00001234`` (atomic on POSIX) and the parent
directory is fsynced. A crash, an exception or a full disk before the
rename leaves only a ``.tmp-*`` directory: it is never taken for a checkpoint, and the next successful
save or ``latest()`` removes it (one whose writer still holds its ``.writer.lock`` flock is left alone).
Retention (``keep``) deletes older complete checkpoints only after the new one is committed, and deletes
by renaming to ``.tmp-*`` first, so a crash mid-delete never leaves a half-deleted ``step-*``; damaged
checkpoints are neither counted nor deleted. ``overwrite=True`` replaces an existing step: the old
directory is renamed aside just before the new one is renamed in (a crash between the two loses that
step, never an older one). One writer per directory: two processes saving into it are not supported.

Guarantees: ``latest()`` returns only a directory whose manifest is intact, whose meta.json matches its
checksum and whose chunk files all exist at their exact sizes (``verify_data=True`` also hashes every
byte). ``read_into`` checks dtype, shape and every segment checksum. ``verify_compatible`` refuses a
checkpoint of another model or config and names each difference. Damage is reported as
``CheckpointCorrupt`` naming the array, file or checksum at fault; mismatches as ``CheckpointMismatch``.

How the engine uses the per-tensor futures: at a step boundary it calls
``handle = writer.save(step, {"master/0": m0, "state/0/exp_avg": ..., ...}, meta)`` with the units in the
order it will next modify them, and returns to training at once. Writes go in that order on a background
thread. Before the optimizer next updates unit ``i`` in place it calls
``handle.wait_for("master/i", "state/i/exp_avg", ...)``: that returns as soon as those tensors are written,
while later units are still being written. If the save fails, ``wait_for`` raises ``CheckpointError``;
either way the writer no longer reads those tensors afterwards, so the update may proceed.
``handle.result()`` returns the committed path (after retention has run) or raises the error. A save
requested while another is still running is queued (FIFO, one writer thread); its tensors are not read
before the earlier save has finished. Resuming: ``path = latest(directory)``, then
``verify_compatible(path, {name: tensor, ...})``, ``load_meta(path)`` and ``read_into(path, name, t)``
for every tensor.

Test: ``pytest tests/test_checkpoint.py`` (about 15 s on a 2-core CPU).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from slidekit.errors import SlidekitError

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "ArrayInfo",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointWriter",
    "Deferred",
    "Manifest",
    "SaveHandle",
    "array_dir_name",
    "decode_tensor",
    "encode_tensor",
    "latest",
    "load_meta",
    "read",
    "read_into",
    "read_manifest",
    "verify",
    "verify_compatible",
]

FORMAT = "slidekit-checkpoint"
FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 64 << 20
_MANIFEST, _META, _LOCK = "manifest.json", "meta.json", ".writer.lock"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_STALE_UNLOCKED_S = 60.0  # a .tmp-* dir without a lock file is a writer's only before its first instant


class CheckpointError(SlidekitError):
    """A checkpoint could not be written or read; the message says why and what to do."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint on disk is damaged: missing or truncated file, checksum mismatch, edited metadata."""


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint is intact but does not match what the caller expects (another model or config)."""


# --------------------------------------------------------------------------- dtypes, names, layout

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _DTYPES[getattr(torch, _name)] = _name
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} cannot be checkpointed; supported: {', '.join(sorted(_BY_NAME))}"
        ) from None


def _ts() -> Any:
    try:
        import tensorstore
    except ImportError as exc:  # pragma: no cover - tensorstore is a dependency
        raise CheckpointError("checkpoints need tensorstore: pip install tensorstore") from exc
    return tensorstore


@functools.cache
def _context() -> Any:
    # file_io_sync: tensorstore fsyncs each chunk file and its directory; no cache: nothing outlives a write.
    return _ts().Context({"file_io_sync": True, "cache_pool": {"total_bytes_limit": 0}})


def array_dir_name(name: str) -> str:
    """The directory (under ``arrays/``) that holds array ``name``: an injective, filesystem-safe encoding."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"array names must be non-empty strings, got {name!r}")
    out = "".join(
        c if c.isascii() and (c.isalnum() or c in "_-.") else "".join(f"%{b:02X}" for b in c.encode())
        for c in name
    )
    if out.startswith("."):
        out = "%2E" + out[1:]
    if len(out) > 200:
        raise CheckpointError(f"array name {name!r} is too long for a directory name; shorten it")
    return out


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> list[int]:
    """Split dimension 0 into blocks of about ``chunk_bytes``; other dimensions stay whole."""
    if not shape:
        return []
    row = itemsize * math.prod(shape[1:])
    rows = max(1, chunk_bytes // max(row, 1))
    return [max(1, min(shape[0], rows))] + [max(1, s) for s in shape[1:]]


def _chunk_files(shape: Sequence[int], chunk: Sequence[int]) -> list[str]:
    """The chunk keys zarr v3's default encoding ("/" separator) gives every chunk of the grid."""
    if not shape:
        return ["c"]
    if 0 in shape:
        return []
    grid = [range(-(-s // c)) for s, c in zip(shape, chunk, strict=True)]
    return ["c/" + "/".join(map(str, idx)) for idx in itertools.product(*grid)]


def _segments(nbytes: int, segment: int) -> list[tuple[int, int]]:
    return [(a, min(a + segment, nbytes)) for a in range(0, nbytes, segment)] or [(0, 0)]


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array sharing its memory (t is contiguous and on the CPU)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _typed(t: torch.Tensor, dtype_name: str) -> np.ndarray:
    return _raw(t).view(_ts().dtype(dtype_name).numpy_dtype).reshape(tuple(t.shape))


# --------------------------------------------------------------------------- checksums


def _resolve_checksum(name: str) -> str:
    if name == "auto":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            return "sha256"
        return "xxh3_128"
    if name not in ("sha256", "xxh3_128"):
        raise CheckpointError(f"unknown checksum {name!r}; choose 'auto', 'sha256' or 'xxh3_128'")
    return name


def _digest(algorithm: str, data: memoryview | bytes) -> str:
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()  # releases the GIL on large buffers
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:
            raise CheckpointError("this checkpoint uses xxh3_128 checksums: pip install xxhash") from exc
        return str(xxhash.xxh3_128_hexdigest(data))
    raise CheckpointCorrupt(f"unknown checksum algorithm {algorithm!r} (known: sha256, xxh3_128)")


def _combine(algorithm: str, segment_digests: Sequence[str]) -> str:
    if len(segment_digests) == 1:
        return segment_digests[0]
    return _digest(algorithm, b"".join(bytes.fromhex(d) for d in segment_digests))


def _hash_segments(
    algorithm: str, raw: np.ndarray, segment: int, pool: ThreadPoolExecutor | None
) -> list[Future[str]]:
    view = raw.data  # a memoryview sharing the tensor's bytes
    futures: list[Future[str]] = []
    for a, b in _segments(raw.nbytes, segment):
        if pool is None:
            done: Future[str] = Future()
            done.set_result(_digest(algorithm, view[a:b]))
            futures.append(done)
        else:
            futures.append(pool.submit(_digest, algorithm, view[a:b]))
    return futures


def _self_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- small file-system helpers


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(root: Path) -> None:
    """fsync every directory under ``root`` (files are synced by their writers: tensorstore's
    ``file_io_sync`` for zarr files, ``_write_synced`` for ours), deepest first, so entries are durable."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        _fsync_path(Path(dirpath), directory=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _lock_held(tmp: Path) -> bool | None:
    """Whether a live writer holds ``tmp``'s lock (None: there is no lock file)."""
    try:
        fd = os.open(tmp / _LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing our own descriptor drops only our flock, never the writer's
    return False


def _cleanup_tmp(directory: Path) -> None:
    """Remove ``.tmp-*`` directories that no live writer owns (left by crashes or failed saves)."""
    for entry in directory.glob(".tmp-*"):
        if not entry.is_dir():
            continue
        held = _lock_held(entry)
        if held or (held is None and time.time() - entry.stat().st_mtime < _STALE_UNLOCKED_S):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    aside = path.with_name(f".tmp-delete-{path.name}-{secrets.token_hex(4)}")
    os.rename(path, aside)  # a crash from here on leaves a .tmp-* dir, never a half-deleted step-*
    shutil.rmtree(aside, ignore_errors=True)


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """One array of a checkpoint, as its manifest describes it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    chunk_shape: tuple[int, ...]
    segments: tuple[str, ...]  # digest of each chunk_bytes-sized run of the raw bytes
    checksum: str  # digest of the raw bytes (one segment) or of the concatenated segment digests


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint's manifest: step, checksum scheme, meta.json's checksum, and its arrays in write order."""

    path: Path
    step: int
    checksum: str
    chunk_bytes: int
    meta_bytes: int
    meta_sha256: str
    arrays: Mapping[str, ArrayInfo] = field(default_factory=dict)


def _parse_manifest(path: Path, doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{path / _MANIFEST} is not a slidekit checkpoint manifest")
    if doc.get("version") != FORMAT_VERSION:
        raise CheckpointCorrupt(
            f"{path / _MANIFEST} has format version {doc.get('version')!r}; this slidekit reads "
            f"version {FORMAT_VERSION}: use the slidekit release that wrote it"
        )
    if doc.get("manifest_sha256") != _self_checksum(doc):
        raise CheckpointCorrupt(f"{path / _MANIFEST} fails its own checksum: it was edited or damaged")
    arrays = {}
    for name, a in doc["arrays"].items():
        if a["dtype"] not in _BY_NAME:
            raise CheckpointCorrupt(f"{path / _MANIFEST}: array {name!r} has unknown dtype {a['dtype']!r}")
        arrays[name] = ArrayInfo(
            name=name,
            dtype=_BY_NAME[a["dtype"]],
            shape=tuple(a["shape"]),
            nbytes=a["nbytes"],
            chunk_shape=tuple(a["chunk_shape"]),
            segments=tuple(a["segments"]),
            checksum=a["checksum"],
        )
    meta = doc["meta"]
    return Manifest(
        path=path,
        step=doc["step"],
        checksum=doc["checksum"],
        chunk_bytes=doc["chunk_bytes"],
        meta_bytes=meta["bytes"],
        meta_sha256=meta["sha256"],
        arrays=MappingProxyType(arrays),
    )


@functools.lru_cache(maxsize=16)
def _manifest_cached(path: Path, _mtime_ns: int, _size: int) -> Manifest:
    try:
        doc = json.loads((path / _MANIFEST).read_bytes())
        return _parse_manifest(path, doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointCorrupt(f"{path / _MANIFEST} is unreadable or incomplete: {exc!r}") from exc


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and self-check ``path``'s manifest (cached while the file is unchanged)."""
    path = Path(path)
    try:
        st = (path / _MANIFEST).stat()
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"{path} has no {_MANIFEST}: it is not a complete checkpoint (an interrupted copy, "
            "or not a checkpoint directory at all)"
        ) from None
    return _manifest_cached(path, st.st_mtime_ns, st.st_size)


def _meta_problem(man: Manifest) -> str | None:
    try:
        data = (man.path / _META).read_bytes()
    except FileNotFoundError:
        return f"{_META} is missing"
    if len(data) != man.meta_bytes or hashlib.sha256(data).hexdigest() != man.meta_sha256:
        return f"{_META} does not match its checksum in the manifest (edited or damaged)"
    return None


def _structure_problems(man: Manifest, info: ArrayInfo) -> list[str]:
    """Missing array directory or chunk files, or chunk files of the wrong size (cheap: stat only)."""
    root = man.path / "arrays" / array_dir_name(info.name)
    if not (root / "zarr.json").is_file():
        return [f"array {info.name!r}: {root / 'zarr.json'} is missing"]
    expected = math.prod(info.chunk_shape) * info.dtype.itemsize
    problems = []
    for key in _chunk_files(info.shape, info.chunk_shape):
        try:
            size = (root / key).stat().st_size
        except FileNotFoundError:
            problems.append(f"array {info.name!r}: chunk file {root / key} is missing")
            continue
        if size != expected:
            problems.append(f"array {info.name!r}: chunk file {root / key} has {size} bytes, not {expected}")
    return problems


def _problems(path: Path, *, data: bool) -> list[str]:
    try:
        man = read_manifest(path)
        problems = [p for p in [_meta_problem(man)] if p]
        for info in man.arrays.values():
            problems += _structure_problems(man, info)
    except (CheckpointError, OSError) as exc:  # OSError: unreadable (permissions, I/O error)
        return [str(exc)]
    if data and not problems:
        for name in man.arrays:
            try:
                read(path, name)
            except (CheckpointError, OSError) as exc:
                problems.append(str(exc))
    return problems


# --------------------------------------------------------------------------- reading


def latest(
    directory: str | os.PathLike[str], *, verify_data: bool = False, cleanup: bool = True
) -> Path | None:
    """The newest complete, undamaged checkpoint in ``directory``, or None.

    Skips ``.tmp-*`` directories and damaged checkpoints (with a ``RuntimeWarning`` naming the damage).
    The default check reads manifest and meta.json and stats every chunk file; ``verify_data=True``
    also hashes every byte. ``cleanup`` removes ``.tmp-*`` directories no live writer owns.
    """
    directory = Path(directory)
    if cleanup and directory.is_dir():
        _cleanup_tmp(directory)
    for _step, path in reversed(_step_dirs(directory)):
        problems = _problems(path, data=verify_data)
        if not problems:
            return path
        warnings.warn(
            f"skipping damaged checkpoint {path}: {'; '.join(problems[:5])}", RuntimeWarning, stacklevel=2
        )
    return None


def load_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The caller's metadata saved with checkpoint ``path``, after checking it against the manifest."""
    man = read_manifest(path)
    problem = _meta_problem(man)
    if problem:
        raise CheckpointCorrupt(f"checkpoint {man.path}: {problem}")
    meta: dict[str, Any] = json.loads((man.path / _META).read_bytes())
    return meta


def _array_info(man: Manifest, name: str) -> ArrayInfo:
    info = man.arrays.get(name)
    if info is None:
        have = list(man.arrays)
        raise CheckpointMismatch(
            f"checkpoint {man.path} has no array {name!r}; it has {len(have)}: {have[:8]}"
            f"{' ...' if len(have) > 8 else ''}"
        )
    return info


def read_into(path: str | os.PathLike[str], name: str, dst: torch.Tensor, *, check: bool = True) -> None:
    """Read array ``name`` of checkpoint ``path`` into ``dst`` (a contiguous CPU tensor of its dtype/shape).

    With ``check`` (the default) every segment checksum is verified after the read; on failure
    ``CheckpointCorrupt`` is raised and ``dst`` holds the damaged data, which must not be used.
    """
    man = read_manifest(path)
    info = _array_info(man, name)
    if dst.device.type != "cpu" or not dst.is_contiguous():
        raise CheckpointMismatch(f"read_into needs a contiguous CPU tensor for {name!r}, got {dst.device}")
    if dst.dtype != info.dtype or tuple(dst.shape) != info.shape:
        raise CheckpointMismatch(
            f"array {name!r} in {man.path} is {info.dtype} {info.shape}, but the destination is "
            f"{dst.dtype} {tuple(dst.shape)}: is this checkpoint from another model or config?"
        )
    problems = _structure_problems(man, info)
    if problems:
        raise CheckpointCorrupt(f"checkpoint {man.path} is damaged: {'; '.join(problems[:5])}")
    ts = _ts()
    root = man.path / "arrays" / array_dir_name(name)
    try:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root)}}
        src = ts.open(spec, open=True, read=True, context=_context()).result()
        if src.dtype.name != _DTYPES[info.dtype] or tuple(src.shape) != info.shape:
            raise CheckpointCorrupt(f"{root / 'zarr.json'} says {src.dtype.name} {tuple(src.shape)}")
        if dst.numel():  # tensorstore decodes the chunks straight into dst's memory
            ts.array(_typed(dst, _DTYPES[info.dtype]), copy=False, write=True).write(src).result()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorrupt(f"array {name!r} of checkpoint {man.path} cannot be read: {exc}") from exc
    if check:
        _check_digests(man, info, dst)


def _check_digests(man: Manifest, info: ArrayInfo, dst: torch.Tensor) -> None:
    raw = _raw(dst)
    spans = _segments(raw.nbytes, man.chunk_bytes)
    workers = min(len(spans), os.cpu_count() or 1, 16)
    with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        digests = [f.result() for f in _hash_segments(man.checksum, raw, man.chunk_bytes, pool)]
    bad = [i for i, (got, want) in enumerate(zip(digests, info.segments, strict=True)) if got != want]
    if bad or _combine(man.checksum, digests) != info.checksum:
        first = spans[bad[0]] if bad else (0, raw.nbytes)
        raise CheckpointCorrupt(
            f"array {info.name!r} of checkpoint {man.path} fails its {man.checksum} checksum "
            f"({len(bad)} of {len(spans)} segments differ, first at bytes {first[0]}..{first[1]}): the "
            "data on disk is not what was saved; resume from an older checkpoint"
        )


def read(path: str | os.PathLike[str], name: str) -> torch.Tensor:
    """Array ``name`` of checkpoint ``path`` as a new CPU tensor, checksum verified."""
    info = _array_info(read_manifest(path), name)
    out = torch.empty(info.shape, dtype=info.dtype)
    read_into(path, name, out)
    return out


def verify(path: str | os.PathLike[str]) -> None:
    """Check everything: manifest, meta.json, chunk files and every array's checksum; raise on damage."""
    problems = _problems(Path(path), data=True)
    if problems:
        raise CheckpointCorrupt(f"checkpoint {path} is damaged: {'; '.join(problems[:8])}")


def verify_compatible(
    path: str | os.PathLike[str],
    expected: Mapping[str, torch.Tensor | tuple[torch.dtype, Sequence[int]]],
    *,
    allow_extra: bool = False,
) -> None:
    """Refuse a checkpoint whose arrays differ from ``expected`` (name -> tensor or (dtype, shape))."""
    man = read_manifest(path)
    want = {
        n: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else (v[0], tuple(v[1]))
        for n, v in expected.items()
    }
    missing = [n for n in want if n not in man.arrays]
    extra = [] if allow_extra else [n for n in man.arrays if n not in want]
    differ = [
        f"{n!r}: checkpoint has {a.dtype} {a.shape}, expected {want[n][0]} {want[n][1]}"
        for n, a in man.arrays.items()
        if n in want and (a.dtype, a.shape) != want[n]
    ]
    if missing or extra or differ:
        parts = []
        if missing:
            parts.append(f"missing arrays {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            parts.append(f"unexpected arrays {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        parts += differ[:8]
        raise CheckpointMismatch(
            f"checkpoint {man.path} does not match this model/config: {'; '.join(parts)}. Resume with "
            "the model and configuration that wrote it, or start from a fresh checkpoint directory"
        )


# --------------------------------------------------------------------------- metadata helpers


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A small tensor (an RNG state, say) as JSON: ``{"dtype", "shape", "base64"}``."""
    t = t.detach().to("cpu").contiguous()
    data = base64.b64encode(_raw(t).tobytes()).decode("ascii")
    return {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "base64": data}


def decode_tensor(doc: Mapping[str, Any]) -> torch.Tensor:
    """The tensor ``encode_tensor`` encoded (bitwise)."""
    raw = bytearray(base64.b64decode(doc["base64"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(_BY_NAME[doc["dtype"]]).reshape(doc["shape"]).clone()


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


@dataclass(eq=False)
class _Job:
    step: int
    items: list[tuple[str, torch.Tensor | Deferred, str]]  # (name, CPU tensor or Deferred, dtype name)
    meta: bytes
    overwrite: bool
    handle: SaveHandle
    where: str = "waiting"  # what the writer was doing, for error messages


@dataclass(eq=False)
class _Write:
    name: str
    tensor: torch.Tensor
    dtype: str
    chunk: list[int]
    write: Any  # tensorstore WriteFutures, None for an empty array
    hashes: list[Future[str]]

    def done(self) -> bool:
        return (self.write is None or self.write.done()) and all(f.done() for f in self.hashes)

    def quiesce(self) -> None:
        """Wait until nothing reads the tensor any more (after a failure), ignoring errors."""
        for f in self.hashes:
            f.cancel()
        for f in self.hashes:
            if not f.cancelled():
                f.exception()
        if self.write is not None:
            self.write.exception()


def _array_spec(root: Path, name: str, dtype: str, shape: Sequence[int], chunk: list[int]) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root)},
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {"slidekit_name": name},
        },
        "store_data_equal_to_fill_value": True,  # every chunk is on disk: a missing one is damage
    }


def _start_write(store: Any, array: np.ndarray) -> Any:
    try:
        # No copy into tensorstore's cache: the caller keeps the tensor unchanged until its future completes.
        return store.write(array, can_reference_source_data_indefinitely=True)
    except TypeError:  # tensorstore without that option copies the source instead
        return store.write(array)


def _make_tmp(directory: Path, step: int) -> tuple[Path, int]:
    while True:
        tmp = directory / f".tmp-{_step_name(step)}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    fd = os.open(tmp / _LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # tells _cleanup_tmp (any process) that this directory is alive
    return tmp, fd


def _meta_bytes(meta: Mapping[str, Any]) -> bytes:
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"checkpoint meta must be a mapping, got {type(meta).__name__}")
    try:
        return json.dumps(dict(meta), indent=1).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint meta must be JSON-serialisable: {exc}; encode tensors with encode_tensor() "
            "and bytes with base64"
        ) from exc


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("slidekit", "tensorstore"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _save_error(job: _Job, exc: BaseException, directory: Path, keep: int | None) -> CheckpointError:
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
        s in text for s in ("No space left", "quota", "File too large")
    ):
        hint = f"free space where {directory} lives, or keep fewer checkpoints (keep={keep})"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS) or any(
        s in text for s in ("Permission denied", "Read-only file system")
    ):
        hint = f"make {directory} writable by this process"
    else:
        hint = "see the chained exception"
    err = CheckpointError(
        f"checkpoint step {job.step} was not saved: {text} (while {job.where}). Fix: {hint}. The partial "
        "write was removed; earlier checkpoints are untouched"
    )
    err.__cause__ = exc
    return err


class CheckpointWriter:
    """Writes a run's checkpoints into ``directory`` on a background thread (see the module docstring).

    Args:
        directory: where the ``step-*`` directories go (created when first needed).
        keep: how many complete checkpoints to keep, newest by step; None keeps them all.
        checksum: "sha256" (the default: any Python can verify it), "xxh3_128" (faster; verifying needs
            ``xxhash``) or "auto" (xxh3_128 when ``xxhash`` is installed, else sha256).
        chunk_bytes: target size of each zarr chunk and of each checksum segment.
        max_inflight: arrays being written at once (tensorstore also writes each array's chunks in parallel).
        hash_threads: threads hashing segments; default min(8, CPUs).
        progress: called on the writer thread as ``progress(stage, detail)``: ``("array", name)`` after each
            array is written, ``("manifest", tmp_dir)``, ``("commit", tmp_dir)`` when everything is synced,
            just before the rename, and ``("committed", final_dir)``. An exception raised before the rename
            aborts the save exactly as an I/O error would (tests inject crashes this way); one raised at
            "committed" becomes a warning.

    Concurrent saves are queued: ``save`` never blocks on an earlier save, and saves run one at a time
    in the order requested. Saving a step that is already queued is refused at once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = 2,
        checksum: str = "sha256",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_inflight: int = 4,
        hash_threads: int | None = None,
        progress: Callable[[str, str], None] | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep must be at least 1 (or None to keep all), got {keep}")
        if chunk_bytes < 1 or max_inflight < 1:
            raise CheckpointError(
                f"chunk_bytes and max_inflight must be positive, got {chunk_bytes}, {max_inflight}"
            )
        self.directory = Path(directory)
        self.keep = keep
        self.checksum = _resolve_checksum(checksum)
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self._hash_threads = hash_threads or min(8, os.cpu_count() or 1)
        self._progress = progress
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()  # queued and running, oldest first
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- public

    def save(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor | Deferred],
        meta: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Queue checkpoint ``step`` of ``tensors`` (written in this order) and ``meta``; return at once.

        CPU tensors are read in place later: keep each unchanged until ``handle.wait_for(name)`` returns.
        Non-contiguous or non-CPU tensors are copied here, synchronously. ``meta`` is serialised here.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        if sys.byteorder != "little":  # pragma: no cover
            raise CheckpointError("checkpoints store little-endian bytes; this host is big-endian")
        items = [self._prepare(name, t) for name, t in tensors.items()]
        data = _meta_bytes({} if meta is None else meta)
        final = self.directory / _step_name(step)
        with self._lock:
            if self._closed:
                raise CheckpointError("this CheckpointWriter is closed; make a new one")
            if any(j.step == step for j in self._jobs):
                raise CheckpointError(f"checkpoint step {step} is already queued or being written")
            if final.exists() and not overwrite:
                raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
            job = _Job(step, items, data, overwrite, SaveHandle(step, [i[0] for i in items], final))
            self._jobs.append(job)
            if self._thread is None:
                # A daemon: a save stuck on hung storage must not keep the interpreter from exiting
                # (the run waits for its saves, bounded, before it returns or closes).
                self._thread = threading.Thread(target=self._worker, name="slidekit-checkpoint", daemon=True)
                self._thread.start()
        newer = [s for s, _ in _step_dirs(self.directory) if s > step]
        if newer:
            warnings.warn(
                f"{self.directory} already holds step {max(newer)} > {step}; latest() will prefer it",
                RuntimeWarning,
                stacklevel=2,
            )
        return job.handle

    @property
    def pending(self) -> int:
        """Saves queued or being written."""
        with self._lock:
            return len(self._jobs)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until every save requested so far has committed or failed (errors stay on the handles)."""
        with self._lock:
            handles = [j.handle for j in self._jobs]
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            h.exception(left)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued saves, then release the writer's threads. Further saves are refused."""
        with self._lock:
            self._closed = True
        self.wait_idle(timeout)
        with self._lock:
            thread, pool, self._pool = self._thread, self._pool, None
        if thread is not None:
            thread.join(timeout)
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- caller side

    def _prepare(self, name: str, t: torch.Tensor | Deferred) -> tuple[str, torch.Tensor | Deferred, str]:
        if isinstance(t, Deferred):
            array_dir_name(name)
            return name, t, _dtype_name(t.dtype)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise CheckpointError(f"checkpoint tensor {name!r} has layout {t.layout}; pass a dense tensor")
        array_dir_name(name)  # validates the name
        dtype = _dtype_name(t.dtype)
        t = t.detach().resolve_conj().resolve_neg()
        if t.device.type != "cpu":
            t = t.to("cpu")
        return name, t.contiguous(), dtype

    # ---- writer thread

    def _worker(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs[0]
            try:
                self._run(job)
            except BaseException as exc:  # a bug here must still reach the caller, not hang it
                if not job.handle.done():
                    self._finish(job, error=_save_error(job, exc, self.directory, self.keep))

    def _finish(self, job: _Job, *, path: Path | None = None, error: CheckpointError | None = None) -> None:
        with self._lock:
            self._jobs.remove(job)
        job.items = []
        if error is not None:
            job.handle._commit.set_exception(error)
        else:
            job.handle._commit.set_result(path)  # type: ignore[arg-type]

    def _stage(self, stage: str, detail: str) -> None:
        if self._progress is not None:
            self._progress(stage, detail)

    def _hash_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._hash_threads, thread_name_prefix="slidekit-ckpt-hash")
            return self._pool

    def _run(self, job: _Job) -> None:
        tmp: Path | None = None
        lock_fd: int | None = None
        try:
            job.where = "creating the temporary directory"
            if not self.directory.is_dir():
                self.directory.mkdir(parents=True, exist_ok=True)
                _fsync_path(self.directory.parent, directory=True)
            tmp, lock_fd = _make_tmp(self.directory, job.step)
            job.where = f"writing {_META}"
            _write_synced(tmp / _META, job.meta)
            (tmp / "arrays").mkdir()
            arrays = self._write_arrays(job, tmp)
            job.where = f"writing {_MANIFEST}"
            _write_synced(tmp / _MANIFEST, self._manifest(job, arrays))
            self._stage("manifest", str(tmp))
            job.where = "syncing files"
            _fsync_dirs(tmp)
            self._stage("commit", str(tmp))
            job.where = "renaming into place"
            final = self._commit(job, tmp)
        except BaseException as exc:  # every failure must reach the handle, whatever it is
            error = _save_error(job, exc, self.directory, self.keep)
            for fut in job.handle._tensors.values():
                if not fut.done():
                    fut.set_exception(error)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if lock_fd is not None:
                os.close(lock_fd)
            self._finish(job, error=error)
            return
        # Committed. What follows can only warn: the checkpoint is good whatever happens now.
        with contextlib.suppress(OSError):
            os.unlink(final / _LOCK)
        os.close(lock_fd)
        try:
            self._prune()
            self._stage("committed", str(final))
        except Exception as exc:
            warnings.warn(
                f"checkpoint {final} committed, but afterwards: {exc!r}", RuntimeWarning, stacklevel=1
            )
        self._finish(job, path=final)

    def _write_arrays(self, job: _Job, tmp: Path) -> dict[str, dict[str, Any]]:
        """Write the arrays in order, ``max_inflight`` at a time; complete their futures in order."""
        written: dict[str, dict[str, Any]] = {}
        inflight: deque[_Write] = deque()
        try:
            for name, tensor, dtype in job.items:
                while len(inflight) >= self.max_inflight:
                    self._complete(job, inflight.popleft(), written)
                job.where = f"writing array {name!r}"
                if isinstance(tensor, Deferred):
                    tensor = self._produce(name, tensor)
                inflight.append(self._start(tmp, name, tensor, dtype))
                while inflight and inflight[0].done():
                    self._complete(job, inflight.popleft(), written)
            while inflight:
                self._complete(job, inflight.popleft(), written)
        except BaseException:
            for w in inflight:  # release every tensor before the handle reports the failure
                w.quiesce()
            raise
        return written

    @staticmethod
    def _produce(name: str, d: Deferred) -> torch.Tensor:
        t = d.produce()
        if t.dtype != d.dtype or tuple(t.shape) != tuple(d.shape) or t.device.type != "cpu":
            raise CheckpointError(
                f"deferred tensor {name!r} produced {t.dtype} {tuple(t.shape)} on {t.device}, "
                f"promised {d.dtype} {tuple(d.shape)} on the CPU"
            )
        return t.contiguous()

    def _start(self, tmp: Path, name: str, tensor: torch.Tensor, dtype: str) -> _Write:
        chunk = _chunk_shape(tensor.shape, tensor.element_size(), self.chunk_bytes)
        spec = _array_spec(tmp / "arrays" / array_dir_name(name), name, dtype, tensor.shape, chunk)
        store = _ts().open(spec, create=True, context=_context()).result()
        w = _Write(name, tensor, dtype, chunk, None, [])
        try:
            if tensor.numel():
                w.write = _start_write(store, _typed(tensor, dtype))
            w.hashes = _hash_segments(self.checksum, _raw(tensor), self.chunk_bytes, self._hash_pool())
        except BaseException:
            w.quiesce()
            raise
        return w

    def _complete(self, job: _Job, w: _Write, written: dict[str, dict[str, Any]]) -> None:
        job.where = f"writing array {w.name!r}"
        try:
            if w.write is not None:
                w.write.result()
            digests = [f.result() for f in w.hashes]
        except BaseException:
            w.quiesce()
            raise
        written[w.name] = {
            "dtype": w.dtype,
            "shape": list(w.tensor.shape),
            "nbytes": w.tensor.numel() * w.tensor.element_size(),
            "chunk_shape": w.chunk,
            "segments": digests,
            "checksum": _combine(self.checksum, digests),
        }
        job.handle._tensors[w.name].set_result(None)
        job.where = f"after writing array {w.name!r}"
        self._stage("array", w.name)

    def _manifest(self, job: _Job, arrays: dict[str, dict[str, Any]]) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": job.step,
            "checksum": self.checksum,
            "chunk_bytes": self.chunk_bytes,
            "created_unix": time.time(),
            "writer": _versions(),
            "meta": {"file": _META, "bytes": len(job.meta), "sha256": hashlib.sha256(job.meta).hexdigest()},
            "arrays": arrays,
        }
        doc["manifest_sha256"] = _self_checksum(doc)
        return json.dumps(doc, indent=1).encode()

    def _commit(self, job: _Job, tmp: Path) -> Path:
        final = self.directory / _step_name(job.step)
        aside = None
        if final.exists():
            if not job.overwrite:
                raise CheckpointError(f"{final} appeared while saving; not replacing it (overwrite=False)")
            aside = final.with_name(f".tmp-replaced-{final.name}-{secrets.token_hex(4)}")
            os.rename(final, aside)
        os.rename(tmp, final)  # the commit point
        _fsync_path(self.directory, directory=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return final

    def _prune(self) -> None:
        if self.keep is not None:
            complete = []
            for _step, path in _step_dirs(self.directory):
                try:
                    read_manifest(path)
                except CheckpointError:
                    continue  # damaged ones are left for a person to look at; latest() skips them
                complete.append(path)
            for path in complete[: -self.keep]:
                _remove_checkpoint(path)
        _cleanup_tmp(self.directory)
