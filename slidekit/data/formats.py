"""Training data records: JSON Lines files of text, prompt/completion, chat, ShareGPT or Alpaca records,
checked line by line.

Formats (one JSON object per line; detected from the first record, then required on every line)::

    {"text": "..."}                                    plain text: every token carries loss
    {"prompt": "...", "completion": "..."}             prompt, then completion (no separator added)
    {"messages": [{"role": "user", "content": "..."}, ...]}   rendered by the tokenizer's chat template
    {"conversations": [{"from": "human", "value": "..."}, ...]}   ShareGPT: mapped to chat
    {"instruction": "...", "input": "...", "output": "..."}       Alpaca: mapped to chat

Roles are "system", "user" and "assistant"; other fields of a record are ignored. ShareGPT's "from"
is "system", "human" (or "user") and "gpt" (or "assistant"), mapped to those roles, "value" to the
content. An Alpaca record becomes two messages: the user's ``instruction``, followed by
``"\n\n" + input`` when ``input`` is a non-empty string (it may be missing, null or ""), then the
assistant's ``output``. Both then go through the chat path (the tokenizer's chat template;
``completion_only`` keeps the loss on the assistant turns). ``columns`` maps a record field to
the column that holds it (``{"text": "body"}`` reads ``text`` from ``body``), before the format is
detected; the same functions check the rows of a Hugging Face dataset (``slidekit.data.hub``).

Malformed input raises ``ConfigError`` naming ``file:line`` and what was expected. ``read_records``
reads a file once: its format off the first record, then every record, hashing the bytes on the way
(``slidekit.fingerprint``). Paths have ``~`` expanded; ``data_file`` is the file ``data.path``
names.

Test: ``python -m pytest -q tests/test_data.py tests/test_data_sources.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

from slidekit.errors import ConfigError
from slidekit.fingerprint import remember_sha256

__all__ = [
    "CHAT_FORMATS",
    "FORMATS",
    "ROLES",
    "SHAREGPT_ROLES",
    "data_file",
    "detect_format",
    "iter_records",
    "read_records",
    "read_texts",
    "record_format",
    "remap",
    "validate_record",
]

FORMATS = ("auto", "text", "prompt_completion", "chat", "sharegpt", "alpaca")
#: Record formats whose payload is a conversation (a list of messages), tokenized as chat.
CHAT_FORMATS = ("chat", "sharegpt", "alpaca")
ROLES = ("system", "user", "assistant")
#: ShareGPT's "from" values and the chat role each becomes.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
_FIELDS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
}
_EXAMPLES = (
    '{"text": ...}, {"prompt": ..., "completion": ...}, {"messages": [{"role": ..., "content": ...}]}, '
    '{"conversations": [{"from": ..., "value": ...}]} or {"instruction": ..., "input": ..., "output": ...}'
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


def detect_format(
    path: str | os.PathLike[str], format: str = "auto", columns: Mapping[str, str] | None = None
) -> str:
    """The record format of ``path``: ``format`` itself unless "auto", else read off the first record."""
    path = Path(path).expanduser()
    return _first_format(path, next(_lines(path), None), format, columns or {})


def remap(record: Mapping[str, Any], columns: Mapping[str, str], where: str) -> dict[str, Any]:
    """``record`` with each field of ``columns`` read from its column (``{"text": "body"}``: text = body)."""
    out = dict(record)
    for key, column in columns.items():
        if column not in record:
            raise ConfigError(
                f"{where}: no column {column!r}, which data.columns reads {key!r} from; the record has "
                f"{sorted(record)} (CLI: --data-columns {key}=COLUMN)"
            )
        out[key] = record[column]
    return out


def record_format(record: Mapping[str, Any], where: str, format: str = "auto") -> str:
    """The format of ``record``: ``format`` itself unless "auto", else the one whose fields it has."""
    if format != "auto":
        return format
    found = [name for name, keys in _FIELDS.items() if all(k in record for k in keys)]
    if len(found) != 1:
        why = "fields of several formats" if found else f"fields {sorted(record)}"
        raise ConfigError(
            f"{where}: cannot tell the record format: it has {why}; expected exactly one of "
            f"{_EXAMPLES}, or set the format explicitly (one of: {', '.join(FORMATS[1:])}), or map "
            "the data's columns to these fields (data.columns, CLI: --data-columns 'text=body')"
        )
    return found[0]


def _first_format(path: Path, first: tuple[int, str] | None, format: str, columns: Mapping[str, str]) -> str:
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
    record = remap(_parse(path, n, line), columns, f"{path}:{n}")
    return record_format(record, f"{path}:{n}", format)


def _field(record: Mapping[str, Any], key: str, want: type, where: str, fmt: str) -> Any:
    value = record.get(key)
    if not isinstance(value, want):
        got = "no such field" if key not in record else _kind(value)
        raise ConfigError(
            f"{where}: expected a {want.__name__} field {key!r} ({fmt} records, as on the first line), got {got}"
        )
    return value


def validate_record(record: Mapping[str, Any], fmt: str, where: str) -> Any:
    """The payload of one record of format ``fmt``: a str, a (prompt, completion) pair or messages
    (``CHAT_FORMATS``: ShareGPT and Alpaca records become chat messages here)."""
    if fmt == "text":
        return _field(record, "text", str, where, fmt)
    if fmt == "prompt_completion":
        return _field(record, "prompt", str, where, fmt), _field(record, "completion", str, where, fmt)
    if fmt == "sharegpt":
        return _sharegpt(record, where)
    if fmt == "alpaca":
        return _alpaca(record, where)
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


def _sharegpt(record: Mapping[str, Any], where: str) -> list[dict[str, str]]:
    turns = _field(record, "conversations", list, where, "sharegpt")
    if not turns:
        raise ConfigError(f'{where}: "conversations" is empty; a conversation needs at least one turn')
    messages = []
    for i, t in enumerate(turns, 1):
        if not isinstance(t, dict):
            raise ConfigError(f'{where}: turn {i} is {_kind(t)}; expected an object with "from" and "value"')
        source = t.get("from")
        role = SHAREGPT_ROLES.get(source) if isinstance(source, str) else None
        if role is None:
            raise ConfigError(
                f"{where}: turn {i} is from {t.get('from')!r}; ShareGPT turns are from one of: "
                f"{', '.join(SHAREGPT_ROLES)}"
            )
        if not isinstance(t.get("value"), str):
            raise ConfigError(f'{where}: turn {i} needs a string "value", got {_kind(t.get("value"))}')
        messages.append({"role": role, "content": t["value"]})
    return messages


def _alpaca(record: Mapping[str, Any], where: str) -> list[dict[str, str]]:
    instruction = _field(record, "instruction", str, where, "alpaca")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ConfigError(f'{where}: "input" must be a string, null or left out, got {_kind(extra)}')
    user = instruction + ("\n\n" + extra if extra else "")
    output = _field(record, "output", str, where, "alpaca")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def read_records(
    path: str | os.PathLike[str], format: str = "auto", columns: Mapping[str, str] | None = None
) -> tuple[str, Iterator[tuple[str, Any]]]:
    """The file's format (``detect_format``) and its records, ``("file:line", payload)`` each checked
    against it, from one pass over the file (its first line is read here)."""
    path = Path(path).expanduser()
    columns = columns or {}
    lines = _lines(path)
    try:
        first = next(lines, None)
        fmt = _first_format(path, first, format, columns)
    except BaseException:
        lines.close()  # the file, open since the first line
        raise
    assert first is not None

    def records() -> Iterator[tuple[str, Any]]:
        for n, line in itertools.chain([first], lines):
            where = f"{path}:{n}"
            yield where, validate_record(remap(_parse(path, n, line), columns, where), fmt, where)

    return fmt, records()


def iter_records(path: str | os.PathLike[str], format: str = "auto") -> Iterator[tuple[str, Any]]:
    """``("file:line", payload)`` for every record, each checked against the file's format."""
    _fmt, records = read_records(path, format)
    yield from records


def read_texts(path: Path) -> list[str]:
    """The ``text`` field of every line of a JSONL file; errors name the file and line."""
    return [text for _, text in iter_records(path, "text")]
