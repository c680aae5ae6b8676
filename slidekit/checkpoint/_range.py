"""Reading a range of a checkpoint's flat array: ``read_range``, checksums checked on what it reads.

A data-parallel run resumed into another world size (``slidekit.distributed.reshard``) reads, on
each rank, only the elements its new shard owns, from as many old parts as that shard spans. The
manifest's checksums cover segments of ``chunk_bytes`` bytes, so a range is verified segment by
segment: the segments inside the range are read straight into the destination and hashed there,
the (at most two) segments it cuts are read whole into a scratch buffer, hashed, and the part of
them inside the range copied over. What ends up in the destination is exactly the bytes that were
verified, and at most two segments more than the range are read.

Test: ``pytest tests/distributed/test_dp_reshard.py`` (``test_read_range_*``).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from slidekit.checkpoint._format import (
    _DTYPES,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    _context,
    _digest,
    _raw,
    _segments,
    _ts,
    _typed,
    array_dir_name,
)
from slidekit.checkpoint._read import ArrayInfo, Manifest, _array_info, _structure_problems, read_manifest

__all__ = ["read_range"]


def read_range(path: str | os.PathLike[str], name: str, start: int, stop: int, dst: torch.Tensor) -> None:
    """Read elements ``[start, stop)`` of the flat (1-D) array ``name`` of checkpoint ``path`` into ``dst``
    (a contiguous CPU tensor of the array's dtype and ``stop - start`` elements), verifying the checksum
    of every segment the range touches. On ``CheckpointCorrupt`` ``dst`` must not be used."""
    man = read_manifest(path)
    info = _array_info(man, name)
    if len(info.shape) != 1:
        raise CheckpointMismatch(
            f"read_range reads flat arrays; {name!r} in {man.path} has shape {info.shape}: use read_into"
        )
    numel = info.shape[0]
    if not 0 <= start <= stop <= numel:
        raise CheckpointMismatch(
            f"read_range({name!r}, {start}, {stop}): the range must lie in [0, {numel}] (the array's length)"
        )
    if dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != info.dtype:
        raise CheckpointMismatch(
            f"read_range needs a contiguous CPU {info.dtype} tensor for {name!r}, got {dst.dtype} on {dst.device}"
        )
    if dst.numel() != stop - start:
        raise CheckpointMismatch(
            f"read_range({name!r}, {start}, {stop}) fills {stop - start} elements, the destination has {dst.numel()}"
        )
    damage = _structure_problems(man, info)
    if damage:
        raise CheckpointCorrupt(f"checkpoint {man.path} is damaged: {'; '.join(damage[:5])}")
    if start == stop:
        return
    try:
        _read_checked(man, info, _open(man, name), start, stop, dst)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorrupt(f"array {name!r} of checkpoint {man.path} cannot be read: {exc}") from exc


def _open(man: Manifest, name: str) -> Any:
    root = man.path / "arrays" / array_dir_name(name)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root)}}
    src = _ts().open(spec, open=True, read=True, context=_context()).result()
    info = man.arrays[name]
    if src.dtype.name != _DTYPES[info.dtype] or tuple(src.shape) != info.shape:
        raise CheckpointCorrupt(f"{root / 'zarr.json'} says {src.dtype.name} {tuple(src.shape)}")
    return src


def _fill(src: Any, a: int, b: int, out: torch.Tensor, dtype: str) -> None:
    """Elements [a, b) of ``src`` decoded straight into ``out``'s memory."""
    if b > a:
        _ts().array(_typed(out, dtype), copy=False, write=True).write(src[a:b]).result()


def _read_checked(man: Manifest, info: ArrayInfo, src: Any, start: int, stop: int, dst: torch.Tensor) -> None:
    size, dtype = info.dtype.itemsize, _DTYPES[info.dtype]
    lo_b, hi_b = start * size, stop * size
    touched = [
        (k, a, b) for k, (a, b) in enumerate(_segments(info.nbytes, man.chunk_bytes)) if a < hi_b and b > lo_b
    ]
    # Segments wholly inside the range, on element boundaries: read into dst in one go, hashed there.
    inside = [(k, a, b) for k, a, b in touched if a >= lo_b and b <= hi_b and a % size == 0 and b % size == 0]
    if inside:
        a0, b0 = inside[0][1] // size, inside[-1][2] // size
        _fill(src, a0, b0, dst[a0 - start : b0 - start], dtype)
        raw = _raw(dst)
        views = [(k, raw[a - lo_b : b - lo_b].data) for k, a, b in inside]
        workers = min(len(views), os.cpu_count() or 1, 16)  # hashlib releases the GIL on large buffers
        with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
            if pool is None:
                for k, view in views:
                    _check(man, info, k, view)
            else:
                for f in [pool.submit(_check, man, info, k, view) for k, view in views]:
                    f.result()
    for k, a, b in touched:
        if (k, a, b) in inside:
            continue
        # A segment the range cuts: read whole, hashed, then the part inside the range copied over.
        e0, e1 = a // size, -(-b // size)
        scratch = torch.empty(e1 - e0, dtype=info.dtype)
        _fill(src, e0, e1, scratch, dtype)
        _check(man, info, k, _raw(scratch)[a - e0 * size : b - e0 * size].data)
        c0, c1 = max(e0, start), min(e1, stop)
        dst[c0 - start : c1 - start].copy_(scratch[c0 - e0 : c1 - e0])


def _check(man: Manifest, info: ArrayInfo, k: int, data: memoryview) -> None:
    if _digest(man.checksum, data) != info.segments[k]:
        a, b = _segments(info.nbytes, man.chunk_bytes)[k]
        raise CheckpointCorrupt(
            f"array {info.name!r} of checkpoint {man.path} fails its {man.checksum} checksum in segment {k} "
            f"(bytes {a}..{b}): the data on disk is not what was saved (a run's resume moves it aside and "
            "falls back to the next older checkpoint)"
        )
