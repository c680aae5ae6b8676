"""Checkpoint format: constants, errors, dtypes, array names and chunk layout, checksums.

The on-disk format is described in ``slidekit.checkpoint``'s docstring.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from slidekit.errors import SlidekitError

FORMAT = "slidekit-checkpoint"
FORMAT_VERSION = 1
DEFAULT_CHUNK_BYTES = 64 << 20
_MANIFEST, _META, _LOCK = "manifest.json", "meta.json", ".writer.lock"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


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
