"""Where training data comes from: which reader a ``data.path`` takes, and the data's fingerprint.

``data.path`` is read by slidekit's own JSONL reader (``slidekit.data.formats``) unless it is a
Hugging Face datasets source (``slidekit.data.hub``): ``hf:NAME[:CONFIG]``, a directory (written by
``save_to_disk``), a ``.parquet`` or ``.csv`` file, or a ``.json`` file that holds one JSON array
(a ``.json`` file of JSON Lines stays with the JSONL reader). A JSONL file has no splits, so its
``data.split`` must stay "train". Either reader gives ``(format, records)``: records are
``(where, payload)``, checked against the format, ready for ``tokenize_records``.

Test: ``python -m pytest -q tests/test_data_sources.py``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from slidekit.data.formats import data_file, read_records
from slidekit.data.hub import FILE_LOADERS, HUB_PREFIX, dataset_files, read_dataset_records
from slidekit.errors import ConfigError

__all__ = ["data_fingerprint", "is_datasets_source", "open_records"]


def _json_array(path: Path) -> bool:
    """Whether the file's first non-blank character opens a JSON array."""
    try:
        with path.open("rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return False
    return head[:1] == b"["


def is_datasets_source(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is read through Hugging Face datasets rather than as JSON Lines."""
    if isinstance(path, str) and path.startswith(HUB_PREFIX):
        return True
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if p.is_dir():
        return True
    if suffix == ".json":
        return _json_array(p)
    return suffix in FILE_LOADERS


def open_records(
    path: str | os.PathLike[str],
    format: str = "auto",
    *,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
) -> tuple[str, Iterator[tuple[str, Any]]]:
    """The record format of ``path`` and its records, by the reader its kind takes."""
    if is_datasets_source(path):
        return read_dataset_records(str(path), format, split=split, columns=columns)
    if split != "train":
        raise ConfigError(
            f"{path} is a JSONL file, which has no split {split!r}; leave data.split at 'train' "
            "(CLI: drop --data-split) or give a dataset with splits"
        )
    return read_records(path, format, columns)


def data_fingerprint(path: str | None, split: str = "train") -> str | None:
    """``sha256:<hex>`` of the bytes of ``data.path`` (the sample corpus for None): the file's, or over
    the names and contents of a datasets source's files. None when there is no such data (yet)."""
    from slidekit.fingerprint import file_sha256

    source = str(data_file(path)) if path is None or not path.startswith(HUB_PREFIX) else path
    if not is_datasets_source(source):
        p = Path(source)
        return file_sha256(p) if p.is_file() else None
    try:
        files = dataset_files(source, split)
    except ConfigError:
        return None  # refused with its reason when the data is read
    if not files:
        return None
    root = os.path.commonpath([str(f.parent) for f in files])
    h = hashlib.sha256()
    for f in files:
        h.update(f"{os.path.relpath(f, root)}\0{file_sha256(f)}\0".encode())
    return "sha256:" + h.hexdigest()
