"""Reading checkpoints: the manifest, damage checks, ``latest``, ``read_into``, compatibility.

See ``slidekit.checkpoint`` for the guarantees.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from slidekit.checkpoint._disk import _cleanup_tmp, _step_dirs
from slidekit.checkpoint._disk import quarantine as _quarantine
from slidekit.checkpoint._format import (
    _BY_NAME,
    _DTYPES,
    _MANIFEST,
    _META,
    FORMAT,
    FORMAT_VERSION,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    _chunk_files,
    _combine,
    _context,
    _hash_segments,
    _raw,
    _segments,
    _self_checksum,
    _ts,
    _typed,
    array_dir_name,
)

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


def problems(path: str | os.PathLike[str], *, verify_data: bool = False) -> list[str]:
    """What is wrong with checkpoint ``path`` (empty: nothing): manifest, meta.json, chunk files present
    at their sizes; ``verify_data`` also hashes every byte against its checksum."""
    path, data = Path(path), verify_data
    try:
        man = read_manifest(path)
        found = [p for p in [_meta_problem(man)] if p]
        for info in man.arrays.values():
            found += _structure_problems(man, info)
    except (CheckpointError, OSError) as exc:  # OSError: unreadable (permissions, I/O error)
        return [str(exc)]
    if data and not found:
        for name in man.arrays:
            try:
                read(path, name)
            except (CheckpointError, OSError) as exc:
                found.append(str(exc))
    return found


# --------------------------------------------------------------------------- reading


def latest(
    directory: str | os.PathLike[str],
    *,
    verify_data: bool = False,
    cleanup: bool = True,
    quarantine: bool = False,
) -> Path | None:
    """The newest complete, undamaged checkpoint in ``directory``, or None.

    Skips ``.tmp-*`` directories and damaged checkpoints (with a ``RuntimeWarning`` naming the damage).
    The default check reads manifest and meta.json and stats every chunk file; ``verify_data=True``
    also hashes every byte. ``cleanup`` removes ``.tmp-*`` directories no live writer owns.
    ``quarantine`` moves each damaged checkpoint it skips aside (``checkpoint.quarantine``), so the
    writer can save that step again; a run's resume does this.
    """
    directory = Path(directory)
    if cleanup and directory.is_dir():
        _cleanup_tmp(directory)
    for _step, path in reversed(_step_dirs(directory)):
        found = problems(path, verify_data=verify_data)
        if not found:
            return path
        what = "; ".join(found[:5])
        if quarantine:
            aside = _quarantine(path, what)
            warnings.warn(
                f"skipping damaged checkpoint {path}: {what}; moved it aside to {aside}",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            warnings.warn(f"skipping damaged checkpoint {path}: {what}", RuntimeWarning, stacklevel=2)
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
    damage = _structure_problems(man, info)
    if damage:
        raise CheckpointCorrupt(f"checkpoint {man.path} is damaged: {'; '.join(damage[:5])}")
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
            "data on disk is not what was saved (a run's resume moves it aside and falls back to the "
            "next older checkpoint)"
        )


def read(path: str | os.PathLike[str], name: str) -> torch.Tensor:
    """Array ``name`` of checkpoint ``path`` as a new CPU tensor, checksum verified."""
    info = _array_info(read_manifest(path), name)
    out = torch.empty(info.shape, dtype=info.dtype)
    read_into(path, name, out)
    return out


def verify(path: str | os.PathLike[str]) -> None:
    """Check everything: manifest, meta.json, chunk files and every array's checksum; raise on damage."""
    found = problems(path, verify_data=True)
    if found:
        raise CheckpointCorrupt(f"checkpoint {path} is damaged: {'; '.join(found[:8])}")


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
