"""Fingerprints of a run's inputs: the initial weights, the tokenizer, the training data file.

A resume compares them with the ones the checkpoint recorded (``slidekit.identity``), so a run is
never continued on other weights or other data by mistake. Each is a ``sha256:<hex>`` string.

Weights (``weights_fingerprint``): reading a 70B model's 140 GB to resume would take minutes, so
the fingerprint reads, per safetensors file, its size and its header (every tensor's name, dtype,
shape and byte range), and per tensor three 4 KiB samples of its bytes (start, middle, end): about
12 KiB per tensor, 9 MB for a 723-tensor 70B model. Two models of the same shape with other values
differ in every sample; what it cannot see is an edit confined to bytes between the samples of a
tensor. It reads no mtime, so a model directory copied or moved elsewhere keeps its fingerprint.
Random initial weights fingerprint as their seed.

Tokenizer and data (``files_fingerprint``, ``file_sha256``): every byte, hashed (tokenizer files are
small; the training data file is read in full anyway when it is tokenized, and the data reader
hashes it on the way: ``remember_sha256``). Results are cached per file path, size and mtime within
a process, so a file is read for its hash at most once, and not at all once the data reader has
read it.

Test: ``pytest tests/test_identity.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path

from slidekit.errors import ModelLoadError

__all__ = [
    "SAMPLE_BYTES",
    "TOKENIZER_FILES",
    "file_sha256",
    "files_fingerprint",
    "remember_sha256",
    "weights_fingerprint",
]

#: Bytes read from the start, the middle and the end of each tensor for the weights fingerprint.
SAMPLE_BYTES = 4096
#: Files in a model directory that make up its tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _key(path: Path, st: os.stat_result | None = None) -> tuple[str, int, int]:
    st = st or path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


#: sha256 digests of files that were read whole for another purpose (``remember_sha256``), by key.
_READ: OrderedDict[tuple[str, int, int], str] = OrderedDict()
_READ_LOCK = threading.Lock()
_READ_MAX = 64


def remember_sha256(path: Path, before: os.stat_result, after: os.stat_result, hexdigest: str) -> None:
    """Note the sha256 of ``path``'s bytes, hashed by whoever read them all (the data reader), so
    ``file_sha256`` need not read the file again. ``before`` and ``after`` are the file's stat when the
    read began and ended (``os.fstat``); a file that changed meanwhile is not noted."""
    key = _key(path, before)
    if key != _key(path, after) or (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
        return
    with _READ_LOCK:
        _READ[key] = hexdigest
        _READ.move_to_end(key)
        while len(_READ) > _READ_MAX:
            _READ.popitem(last=False)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, _size: int, _mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of every byte of ``path`` (read once per size and mtime in a process)."""
    key = _key(Path(path))
    with _READ_LOCK:
        known = _READ.get(key)
    return "sha256:" + (known if known is not None else _sha256_cached(*key))


def files_fingerprint(
    directory: str | os.PathLike[str], names: Iterable[str] = TOKENIZER_FILES
) -> str | None:
    """``sha256:<hex>`` over the ``names`` present in ``directory`` (name and content); None if none is."""
    directory = Path(directory)
    h = hashlib.sha256()
    found = False
    for name in sorted(names):
        path = directory / name
        if path.is_file():
            found = True
            h.update(f"{name}\0{file_sha256(path)}\0".encode())
    return "sha256:" + h.hexdigest() if found else None


def _header(fd: int, path: Path) -> tuple[bytes, int]:
    """A safetensors file's raw JSON header and where its data starts."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    header = os.pread(fd, n, 8)
    if len(header) != n:
        raise ValueError(f"{path} is not a safetensors file (its header is cut short)")
    return header, 8 + n


def _samples(start: int, stop: int) -> list[tuple[int, int]]:
    """Byte ranges of one tensor's samples: all of it when small, else its start, middle and end."""
    if stop - start <= 3 * SAMPLE_BYTES:
        return [(start, stop)]
    mid = start + (stop - start) // 2 - SAMPLE_BYTES // 2
    return [(start, start + SAMPLE_BYTES), (mid, mid + SAMPLE_BYTES), (stop - SAMPLE_BYTES, stop)]


@functools.lru_cache(maxsize=64)
def _safetensors_cached(path_str: str, size: int, _mtime_ns: int) -> str:
    path = Path(path_str)
    h = hashlib.sha256(f"{size}\0".encode())
    with open(path, "rb") as f:
        header, base = _header(f.fileno(), path)
        h.update(header)
        entries = [v for k, v in json.loads(header).items() if k != "__metadata__"]
        for entry in sorted(entries, key=lambda e: e["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            for a, b in _samples(base + begin, base + end):
                h.update(os.pread(f.fileno(), b - a, a))
    return h.hexdigest()


def weights_fingerprint(files: Mapping[str, Path], *, init_seed: int | None = None) -> str:
    """Fingerprint of the initial weights: of the safetensors ``files`` (parameter name -> file, as
    ``models.loading.weight_files`` gives), or, with no files, of random weights from ``init_seed``."""
    if not files:
        return f"random-init:seed={init_seed}"
    h = hashlib.sha256()
    for path in sorted({Path(p) for p in files.values()}, key=lambda p: p.name):
        try:
            digest = _safetensors_cached(*_key(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot fingerprint the weights in {path}: {exc}") from exc
        h.update(f"{path.name}\0{digest}\0".encode())
    return "sha256:" + h.hexdigest()
