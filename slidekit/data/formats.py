"""Training data records: JSON Lines files of text, prompt/completion or chat records, checked line by line.

Formats (one JSON object per line; detected from the first record, then required on every line)::

    {"text": "..."}                                    plain text: every token carries loss
    {"prompt": "...", "completion": "..."}             prompt, then completion (no separator added)
    {"messages": [{"role": "user", "content": "..."}, ...]}   rendered by the tokenizer's chat template

Roles are "system", "user" and "assistant"; other fields of a record are ignored. Malformed input
raises ``ConfigError`` naming ``file:line`` and what was expected. ``read_records`` reads a file
once: its format off the first record, then every record, hashing the bytes on the way
(``slidekit.fingerprint``). Paths have ``~`` expanded; ``data_file`` is the file ``data.path``
names.

Test: ``python -m pytest -q tests/test_data.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from slidekit.errors import ConfigError
from slidekit.fingerprint import remember_sha256

__all__ = ["FORMATS", "ROLES", "data_file", "detect_format", "iter_records", "read_records", "read_texts"]

FORMATS = ("auto", "text", "prompt_completion", "chat")
ROLES = ("system", "user", "assistant")
_FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "chat": ("messages",)}
_EXAMPLES = (
    '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [{"role": ..., "content": ...}]}'
)
_JSONL = "each line must be one JSON object, such as " + _EXAMPLES


def data_file(path: str | os.PathLike[str] | None) -> Path:
    """The training data file ``data.path`` names (``~`` expanded), or the demo corpus for None."""
    if path is None:
        from slidekit.models.loading import demo_dir

        return demo_dir() / "corpus.jsonl"
    return Path(path).expanduser()


def _lines(path: Path) -> Generator[tuple[int, str], None, None]:
    """(line number, line) for every non-blank line; a missing or non-UTF-8 file is a ConfigError.

    The bytes are hashed as they are read: a file read to its end leaves its sha256 with
    ``slidekit.fingerprint``, so the run's identity need not read it again.
    """
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    digest = hashlib.sha256()
    with path.open("rb") as f:  # bytes, so that a decoding error names its line
        before = os.fstat(f.fileno())
        for n, raw in enumerate(f, 1):
            digest.update(raw)
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM may open the file
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not UTF-8 text ({exc.reason}); {_JSONL}") from None
            if line.strip():
                yield n, line
        remember_sha256(path, before, os.fstat(f.fileno()), digest.hexdigest())


def _kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _parse(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno}); {_JSONL}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}:{n}: expected a JSON object, got {_kind(record)}; {_JSONL}")
    return record


def detect_format(path: str | os.PathLike[str], format: str = "auto") -> str:
    """The record format of ``path``: ``format`` itself unless "auto", else read off the first record."""
    path = Path(path).expanduser()
    return _first_format(path, next(_lines(path), None), format)


def _first_format(path: Path, first: tuple[int, str] | None, format: str) -> str:
    """The format the first non-blank line of ``path`` (None: there is none) says the file holds."""
    if first is None:
        raise ConfigError(f"data file {str(path)!r} is empty; {_JSONL}")
    n, line = first
    start = line.lstrip()[:1]
    if start == "[":
        raise ConfigError(
            f"{path}:{n}: the file is a JSON array, not JSON Lines; write one object per line "
            f"(for example: jq -c '.[]' {path.name}); {_JSONL}"
        )
    try:
        json.loads(line)
    except json.JSONDecodeError as exc:
        if start != "{":
            raise ConfigError(
                f"{path}:{n}: the file is not JSON Lines: its first line is not JSON (CSV or plain text?); {_JSONL}"
            ) from None
        if not line.rstrip().endswith("}"):
            raise ConfigError(
                f"{path}:{n}: the first line is not a whole JSON object ({exc.msg}); if the file is one JSON "
                f"document spread over several lines, write one object per line; {_JSONL}"
            ) from None
    record = _parse(path, n, line)
    if format != "auto":
        return format
    found = [name for name, keys in _FIELDS.items() if all(k in record for k in keys)]
    if len(found) != 1:
        why = "fields of several formats" if found else f"fields {sorted(record)}"
        raise ConfigError(
            f"{path}:{n}: cannot tell the record format: it has {why}; expected exactly one of "
            f"{_EXAMPLES}, or set the format explicitly (one of: {', '.join(FORMATS[1:])})"
        )
    return found[0]


def _field(record: dict[str, Any], key: str, want: type, where: str, fmt: str) -> Any:
    value = record.get(key)
    if not isinstance(value, want):
        got = "no such field" if key not in record else _kind(value)
        raise ConfigError(
            f"{where}: expected a {want.__name__} field {key!r} ({fmt} records, as on the first line), got {got}"
        )
    return value


def _validate(record: dict[str, Any], fmt: str, where: str) -> Any:
    """The payload of one record of format ``fmt``: a str, a (prompt, completion) pair or messages."""
    if fmt == "text":
        return _field(record, "text", str, where, fmt)
    if fmt == "prompt_completion":
        return _field(record, "prompt", str, where, fmt), _field(record, "completion", str, where, fmt)
    messages = _field(record, "messages", list, where, fmt)
    if not messages:
        raise ConfigError(f'{where}: "messages" is empty; a conversation needs at least one message')
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: message {i} is {_kind(m)}; expected an object with role and content")
        if m.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {m.get('role')!r}; choose one of: {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise ConfigError(f'{where}: message {i} needs a string "content", got {_kind(m.get("content"))}')
    return messages


def read_records(path: str | os.PathLike[str], format: str = "auto") -> tuple[str, Iterator[tuple[str, Any]]]:
    """The file's format (``detect_format``) and its records, ``("file:line", payload)`` each checked
    against it, from one pass over the file (its first line is read here)."""
    path = Path(path).expanduser()
    lines = _lines(path)
    try:
        first = next(lines, None)
        fmt = _first_format(path, first, format)
    except BaseException:
        lines.close()  # the file, open since the first line
        raise
    assert first is not None

    def records() -> Iterator[tuple[str, Any]]:
        for n, line in itertools.chain([first], lines):
            yield f"{path}:{n}", _validate(_parse(path, n, line), fmt, f"{path}:{n}")

    return fmt, records()


def iter_records(path: str | os.PathLike[str], format: str = "auto") -> Iterator[tuple[str, Any]]:
    """``("file:line", payload)`` for every record, each checked against the file's format."""
    _fmt, records = read_records(path, format)
    yield from records


def read_texts(path: Path) -> list[str]:
    """The ``text`` field of every line of a JSONL file; errors name the file and line."""
    return [text for _, text in iter_records(path, "text")]
