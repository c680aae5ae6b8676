"""Training data from Hugging Face ``datasets`` (the optional extra ``pip install 'slidekit[hf]'``).

Three kinds of source, each read without any download:

* a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (``load_from_disk``;
  a DatasetDict's split is ``data.split``, a single Dataset is used whole);
* a ``.parquet``, ``.csv`` or ``.json`` (one JSON array) file, streamed by datasets' packaged loaders
  (nothing is written to the datasets cache); JSON Lines stay with slidekit's own reader, which is
  exact and names the line of a bad record;
* ``hf:NAME`` or ``hf:NAME:CONFIG``: a dataset in the local Hugging Face datasets cache (what
  ``load_dataset(NAME)`` left there when it last ran online), read by datasets' own cache builder,
  the one ``load_dataset`` falls back to offline. The cache is ``$HF_DATASETS_CACHE``, else
  ``$HF_HOME/datasets``, else ``~/.cache/huggingface/datasets``, read when the data is loaded.

Rows are mapped by ``data.columns`` and checked by the same functions as JSONL records
(``slidekit.data.formats``): the format is detected from the column names, every row is validated,
and errors name the source and the row (``train.parquet:row 12``, ``hf:org/name[train]:row 3``).

Test: ``python -m pytest -q tests/test_data_sources.py``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from slidekit.data.formats import record_format, remap, validate_record
from slidekit.errors import ConfigError

__all__ = ["FILE_LOADERS", "HUB_PREFIX", "cache_dir", "dataset_files", "dataset_rows", "read_dataset_records"]

#: The prefix of a dataset in the local Hugging Face cache: ``hf:NAME`` or ``hf:NAME:CONFIG``.
HUB_PREFIX = "hf:"
#: File suffixes read through datasets, and the packaged loader of each.
FILE_LOADERS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
_INSTALL = "pip install 'slidekit[hf]'"


def _datasets(what: str) -> Any:
    """The ``datasets`` module, imported on first use; a ConfigError naming the extra when it is missing."""
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(
            f"{what} is read with Hugging Face datasets, which is not installed ({exc}); install it: {_INSTALL}"
        ) from None
    return datasets


def cache_dir() -> Path:
    """Where the Hugging Face datasets cache is, by the rule datasets itself follows, read now."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "datasets"


def _hub_name(path: str) -> tuple[str, str | None]:
    """(NAME, CONFIG or None) of ``hf:NAME[:CONFIG]``."""
    name, sep, config = path[len(HUB_PREFIX) :].partition(":")
    if not name or name.count("/") > 1 or (sep and not config):
        raise ConfigError(
            f"data path {path!r} is not hf:NAME or hf:NAME:CONFIG (e.g. hf:tatsu-lab/alpaca, hf:openai/gsm8k:main)"
        )
    return name, config or None


def _from_cache(path: str, split: str) -> tuple[Any, str]:
    """The split of an ``hf:`` dataset from the local cache, and its label."""
    name, config = _hub_name(path)
    _datasets(f"data path {path!r}")
    from datasets.packaged_modules.cache.cache import Cache  # what load_dataset reads offline

    where = cache_dir()
    try:
        builder = Cache(
            cache_dir=str(where),
            repo_id=name,
            dataset_name=name.split("/")[-1],
            config_name=config,
            version="auto",
            hash="auto",
        )
    except ValueError as exc:
        lines = str(exc).splitlines()
        if "multiple" in lines[0]:
            raise ConfigError(f"data path {path!r}: {lines[0]}; pick one: hf:{name}:CONFIG") from None
        raise ConfigError(
            f"data path {path!r}: the dataset is not in the local Hugging Face cache {where} "
            f"({'; '.join(lines)}). slidekit never downloads during a run: load it once where there is a "
            f"network (python -c \"import datasets; datasets.load_dataset('{name}')\"), or save it with "
            "save_to_disk and pass that directory"
        ) from None
    splits = list(builder.info.splits or {})
    if split not in splits:
        raise ConfigError(
            f"data path {path!r} has no split {split!r}; its splits are {splits} (CLI: --data-split)"
        )
    return builder.as_dataset(split=split), f"{path}[{split}]"


def _from_disk(path: Path, split: str) -> tuple[Any, str]:
    """A dataset directory written by save_to_disk (the split of a DatasetDict), and its label."""
    ds = _datasets(f"the dataset directory {str(path)!r}")
    try:
        loaded = ds.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"data path {str(path)!r} is a directory but no dataset saved by save_to_disk ({exc}); give a "
            "JSONL file, a save_to_disk directory, a .parquet/.csv/.json file or hf:NAME"
        ) from None
    if isinstance(loaded, ds.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"the dataset in {path} has no split {split!r}; its splits are {list(loaded)} (CLI: --data-split)"
            )
        return loaded[split], f"{path}[{split}]"
    if split != "train":
        raise ConfigError(
            f"{path} holds one dataset, not a DatasetDict with splits: it has no split {split!r}; leave "
            "data.split at 'train' (CLI: drop --data-split)"
        )
    return loaded, str(path)


def _from_file(path: Path, split: str) -> tuple[Any, str]:
    """A .parquet/.csv/.json file, streamed (no cache is written), and its label."""
    ds = _datasets(f"the data file {str(path)!r}")
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    if split != "train":
        raise ConfigError(
            f"{path} is one file, which has no split {split!r}; leave data.split at 'train' (CLI: drop --data-split)"
        )
    loader = FILE_LOADERS[path.suffix.lower()]
    try:
        return ds.load_dataset(loader, data_files=str(path), split="train", streaming=True), str(path)
    except Exception as exc:
        raise ConfigError(f"{path}: datasets cannot read it as {loader} ({exc})") from None


def dataset_rows(path: str | Path, split: str = "train") -> tuple[Iterable[Mapping[str, Any]], str]:
    """The rows of a datasets source (``hf:NAME``, a save_to_disk directory, a file of ``FILE_LOADERS``)
    as mappings, and the label its errors use."""
    if isinstance(path, str) and path.startswith(HUB_PREFIX):
        return _from_cache(path, split)
    p = Path(path).expanduser()
    if p.is_dir():
        return _from_disk(p, split)
    return _from_file(p, split)


def dataset_files(path: str | Path, split: str = "train") -> list[Path]:
    """The files that hold a datasets source's data, for its fingerprint: a save_to_disk directory's
    files, an ``hf:`` dataset's cache directory's files, or the file itself."""
    if isinstance(path, str) and path.startswith(HUB_PREFIX):
        rows, _ = _from_cache(path, split)
        return sorted({Path(f["filename"]) for f in rows.cache_files})
    p = Path(path).expanduser()
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    return [p]


def _columns(rows: Iterable[Mapping[str, Any]]) -> tuple[list[str] | None, Iterator[Mapping[str, Any]]]:
    """The column names (from the schema, else the first row) and the rows, none consumed."""
    names = getattr(rows, "column_names", None)
    it = iter(rows)
    if names is not None:
        return list(names), it
    first = next(it, None)
    if first is None:
        return None, iter(())
    return list(first), itertools.chain([first], it)


def read_dataset_records(
    path: str | Path, format: str = "auto", *, split: str = "train", columns: Mapping[str, str] | None = None
) -> tuple[str, Iterator[tuple[str, Any]]]:
    """The format of a datasets source and its records, ``("label:row N", payload)``, each checked as
    a JSONL record is: the format comes from the column names (after ``columns``), or ``format``."""
    columns = columns or {}
    rows, label = dataset_rows(path, split)
    names, it = _columns(rows)
    if not names:
        raise ConfigError(f"the dataset {label} holds no rows; give data with at least one record")
    fmt = record_format(
        remap(dict.fromkeys(names), columns, f"{label} (columns)"), f"{label} (columns)", format
    )

    def records() -> Iterator[tuple[str, Any]]:
        n = 0
        for n, row in enumerate(it, 1):
            where = f"{label}:row {n}"
            yield where, validate_record(remap(row, columns, where), fmt, where)
        if n == 0:
            raise ConfigError(f"the dataset {label} holds no rows; give data with at least one record")

    return fmt, records()
