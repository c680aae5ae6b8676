"""Training data: JSONL records, tokenized, loss-masked, packed (or padded) into rows, split, batched.

Formats (one JSON object per line; detected from the first record, then required on every line)::

    {"text": "..."}                                    plain text: every token carries loss
    {"prompt": "...", "completion": "..."}             prompt, then completion (no separator added)
    {"messages": [{"role": "user", "content": "..."}, ...]}   rendered by the tokenizer's chat template

Roles are "system", "user" and "assistant"; other fields of a record are ignored. Malformed input
raises ``ConfigError`` naming ``file:line`` and what was expected.

Loss mask. Each token carries a flag "predicting this token carries loss". Without
``completion_only`` every token does. With it: for prompt/completion records only the completion
tokens (prompt and completion are tokenized separately, so the boundary is exact and the prompt is
tokenized as it will be at inference); for chat records only the assistant turns. An assistant span
starts where the template's generation prompt ends (``apply_chat_template(messages[:i],
add_generation_prompt=True)``, used when it is a prefix of the whole rendering) and ends after the
message's content plus the one special token right after it, the end-of-turn marker (``<|im_end|>``
in ChatML; the newline after it carries no loss). When a template is not prefix-stable (it renders
earlier turns differently once later ones exist) the span starts where the content does. Spans are
found on characters and mapped to tokens with the fast tokenizer's offsets; a token straddling the
boundary counts as the assistant's. A template that does not reproduce an assistant's content is
refused (``completion_only`` cannot be honoured there).

Framing and packing. Each document becomes ``[BOS] tokens [EOS]`` (BOS only if the tokenizer has one;
neither is doubled when the chat template already wrote it). Packing concatenates the framed
documents and cuts rows of ``seq_len + 1`` tokens (the last row padded); a row gives
``input_ids = row[:-1]`` and ``labels = row[1:]``, label -100 where the target carries no loss.
Across a boundary the targets are ``last -> EOS`` (the document ends) and ``EOS -> BOS`` (a new one
starts): real next-token targets, never ``last -> first of the next document``. They carry loss
unless ``completion_only``, where EOS carries the loss of the token before it (a completion learns
to stop) and BOS none. ``packing=False`` puts one framed document per row, truncated to
``seq_len + 1`` or right-padded with the pad token (EOS if there is none), padding labelled -100.
Rows without a single labelled token are dropped (a step must have something to learn from). Packed
training data must fill at least one row.

Padding token. The tokenizer's pad token only fills rows; training treats the *model's*
``pad_token_id`` (config.json) as transformers does: its embedding row gets no gradient from the
lookup, wherever it occurs, so where the model's pad is EOS the EOS row learns only through a tied
LM head (and shrinks by weight decay). See docs/design.md, "The padding token".

Split and order. ``eval_fraction`` of the documents (not rows) is held out by a seeded permutation,
so the split depends only on the file and ``DataSpec.seed``. Training batches are endless: each
epoch is a fresh permutation of the rows from a generator seeded by the ``batches`` seed. Evaluation
batches are one pass in file order.

    train, held_out = build_datasets(DataSpec(path="d.jsonl", seq_len=512, eval_fraction=0.05), tok)
    batch = next(train.batches(batch_size=8, seed=0))

Test: ``python -m pytest -q tests/test_data.py``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidekit.errors import ConfigError
from slidekit.inputs import IGNORE_INDEX, check_pair

__all__ = [
    "FORMATS",
    "Batch",
    "DataSpec",
    "DataStats",
    "Documents",
    "PackedDataset",
    "build_datasets",
    "detect_format",
    "iter_records",
    "load_tokenizer",
    "read_texts",
    "split_documents",
    "tokenize_records",
]

FORMATS = ("auto", "text", "prompt_completion", "chat")
ROLES = ("system", "user", "assistant")
_FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "chat": ("messages",)}
_EXAMPLES = (
    '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [{"role": ..., "content": ...}]}'
)
_JSONL = "each line must be one JSON object, such as " + _EXAMPLES


@dataclass(frozen=True, slots=True)
class Batch:
    """One micro-batch: ``input_ids`` and ``labels``, integer tensors (B, T); label -100 where no loss is taken.

    ``labels[b, t]`` is the token that follows ``input_ids[b, t]``. Batches of
    one step (``grad_accum``) may differ in B and T; padding them to the
    longest row, with label -100 on the padding, changes nothing (causal
    attention: a real token never sees the padding after it). The model's
    ``pad_token_id`` (from its config.json) gets no gradient through the
    embedding lookup, as in transformers (``nn.Embedding(padding_idx=...)``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        check_pair(self.input_ids, self.labels)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """What ``build_datasets`` builds."""

    path: str | Path  # the JSONL file
    format: str = "auto"  # one of FORMATS; "auto" reads it off the first record
    seq_len: int = 128  # tokens per row (each row holds seq_len + 1: inputs and shifted labels)
    completion_only: bool = False  # loss on completions / assistant turns only (not for "text")
    packing: bool = True  # concatenate documents into full rows; False: one padded document per row
    eval_fraction: float = 0.0  # fraction of documents held out for evaluation (0: none)
    seed: int = 0  # seeds the held-out split (the batch order has its own seed)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"data format {self.format!r} is unknown; choose one of: {', '.join(FORMATS)}")
        if self.seq_len <= 0:
            raise ConfigError(f"data seq_len must be > 0, got {self.seq_len}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data eval_fraction must be in [0, 1), got {self.eval_fraction}")


def load_tokenizer(directory: Path) -> Any:
    """The fast tokenizer saved in a model directory (offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {str(directory)!r}: {exc}") from exc


# ---------------------------------------------------------------------------------------- reading


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) for every non-blank line; a missing or non-UTF-8 file is a ConfigError."""
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    with path.open("rb") as f:  # bytes, so that a decoding error names its line
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM may open the file
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not UTF-8 text ({exc.reason}); {_JSONL}") from None
            if line.strip():
                yield n, line


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


def detect_format(path: str | Path, format: str = "auto") -> str:
    """The record format of ``path``: ``format`` itself unless "auto", else read off the first record."""
    path = Path(path)
    first = next(_lines(path), None)
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


def iter_records(path: str | Path, format: str = "auto") -> Iterator[tuple[str, Any]]:
    """``("file:line", payload)`` for every record, each checked against the file's format."""
    path = Path(path)
    fmt = detect_format(path, format)
    for n, line in _lines(path):
        yield f"{path}:{n}", _validate(_parse(path, n, line), fmt, f"{path}:{n}")


def read_texts(path: Path) -> list[str]:
    """The ``text`` field of every line of a JSONL file; errors name the file and line."""
    return [text for _, text in iter_records(path, "text")]


# ---------------------------------------------------------------------------------------- tokenizing


@dataclass(frozen=True, slots=True)
class Documents:
    """Tokenized documents, flat: document ``i`` is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # (N,) int32
    loss: np.ndarray  # (N,) bool: predicting this token carries loss
    offsets: np.ndarray  # (D + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1


def _render(tokenizer: Any, messages: list[dict[str, Any]], where: str, prompt: bool = False) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    except Exception as exc:
        raise ConfigError(f"{where}: the chat template refused this conversation: {exc}") from None
    return str(text)


def _find(full: str, content: str, lo: int) -> tuple[int, int]:
    """(start, end) of ``content`` in ``full`` at or after ``lo`` (trimmed if the template trims); -1s if absent."""
    for c in (content, content.strip()):
        pos = full.find(c, lo)
        if pos >= 0:
            return pos, pos + len(c)
    return -1, -1


def _assistant_spans(
    tokenizer: Any, messages: list[dict[str, Any]], full: str, where: str
) -> list[tuple[int, int]]:
    """Character spans of ``full`` (the rendering) that the assistant turns produce, in order."""
    spans, cursor = [], 0  # cursor: never past the end of the previous message's content
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            pos, end = _find(full, m["content"], cursor) if m["content"] else (-1, -1)
            cursor = end if pos >= 0 else cursor
            continue
        try:
            head: str | None = _render(tokenizer, messages[:i], where, prompt=True)
        except ConfigError:
            head = None  # some templates refuse a conversation that opens with the assistant
        start = len(head) if head is not None and full.startswith(head) and len(head) >= cursor else None
        pos, end = _find(full, m["content"], cursor if start is None else start)
        if pos < 0:
            raise ConfigError(
                f"{where}: the chat template does not reproduce assistant message {i + 1} verbatim, so its "
                "tokens cannot be told apart; turn completion_only off or use a template that keeps content"
            )
        spans.append((pos if start is None else start, end))
        cursor = end
    return spans


def _span_mask(
    ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], special: set[int]
) -> np.ndarray:
    """Tokens overlapping a span, plus the special token (end-of-turn) right after each span."""
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for begin, end in spans:
        inside = (offs[:, 0] < end) & (offs[:, 1] > begin)
        hits = np.flatnonzero(inside)
        after = int(hits[-1]) + 1 if hits.size else int(np.searchsorted(offs[:, 0], end))
        mask |= inside
        if after < len(ids) and ids[after] in special:
            mask[after] = True
    return mask


def _special_ids(tokenizer: Any) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {int(i) for i, tok in added.items() if getattr(tok, "special", False)} | set(
        tokenizer.all_special_ids
    )


def _encode(
    fmt: str, chunk: list[tuple[str, Any]], tokenizer: Any, completion_only: bool
) -> tuple[list[list[int]], list[np.ndarray | None]]:
    """Token ids and loss masks (None: every token) of one chunk of records, in one batched call each."""

    def tok(texts: list[str], **kw: Any) -> Any:
        return tokenizer(texts, add_special_tokens=False, verbose=False, **kw)  # verbose: no length warning

    payloads = [p for _, p in chunk]
    if fmt == "text":
        return tok(payloads)["input_ids"], [None] * len(chunk)
    if fmt == "prompt_completion":
        prompts = tok([p for p, _ in payloads])["input_ids"]
        completions = tok([c for _, c in payloads])["input_ids"]
        ids = [p + c for p, c in zip(prompts, completions, strict=True)]
        if not completion_only:
            return ids, [None] * len(chunk)
        masks = [
            np.repeat([False, True], [len(p), len(c)]) for p, c in zip(prompts, completions, strict=True)
        ]
        return ids, list(masks)
    texts = [_render(tokenizer, messages, where) for where, messages in chunk]
    if not completion_only:
        return tok(texts)["input_ids"], [None] * len(chunk)
    enc = tok(texts, return_offsets_mapping=True)
    special = _special_ids(tokenizer)
    out: list[np.ndarray | None] = []
    for (where, messages), text, ids, offsets in zip(
        chunk, texts, enc["input_ids"], enc["offset_mapping"], strict=True
    ):
        out.append(_span_mask(ids, offsets, _assistant_spans(tokenizer, messages, text, where), special))
    return enc["input_ids"], out


def tokenize_records(
    records: Iterable[tuple[str, Any]],
    fmt: str,
    tokenizer: Any,
    *,
    completion_only: bool = False,
    chunk_size: int = 1024,
) -> Documents:
    """Tokenize ``(where, payload)`` records of format ``fmt``, ``chunk_size`` at a time, into flat arrays."""
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            'the data holds chat records ({"messages": [...]}) but the tokenizer has no chat template; use '
            "a tokenizer with one (chat_template in tokenizer_config.json) or write prompt/completion records"
        )
    if completion_only and fmt == "text":
        raise ConfigError(
            "completion_only needs prompt/completion or chat records, but the data holds text records; "
            'turn completion_only off or write {"prompt": ..., "completion": ...} records'
        )
    ids_parts, loss_parts, lengths = [], [], []
    it = iter(records)
    while chunk := list(itertools.islice(it, chunk_size)):
        ids, masks = _encode(fmt, chunk, tokenizer, completion_only)
        n = [len(d) for d in ids]
        ids_parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=sum(n)))
        if all(m is None for m in masks):
            loss_parts.append(np.ones(sum(n), dtype=bool))
        else:
            loss_parts.append(
                np.concatenate([np.ones(k, bool) if m is None else m for k, m in zip(n, masks, strict=True)])
            )
        lengths.extend(n)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    empty = np.zeros(0, np.int32)
    return Documents(
        np.concatenate(ids_parts) if ids_parts else empty,
        np.concatenate(loss_parts) if loss_parts else empty.astype(bool),
        offsets,
    )


# ---------------------------------------------------------------------------------------- rows


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, each ascending: ``round(eval_fraction * n_docs)`` held out by seed."""
    n_eval = round(eval_fraction * n_docs)
    if eval_fraction > 0:
        if n_docs < 2:
            raise ConfigError(
                f"eval_fraction {eval_fraction} needs at least 2 documents; the data holds {n_docs}"
            )
        n_eval = min(max(n_eval, 1), n_docs - 1)
    order = torch.randperm(n_docs, generator=torch.Generator().manual_seed(seed)).numpy()
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def _frame(
    docs: Documents, index: np.ndarray, tokenizer: Any, completion_only: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[BOS] doc [EOS]`` for the documents in ``index``, concatenated: (ids, loss, offsets)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "the tokenizer has no eos_token, so documents cannot be separated; use one that has"
        )
    starts = docs.offsets[index]
    lengths = docs.offsets[index + 1] - starts
    full = lengths > 0
    ids_x, loss_x = np.append(docs.ids, -1), np.append(docs.loss, False)  # a sentinel for empty documents
    last = starts + lengths - 1  # -1 (the sentinel) or a neighbour's token for empty ones: masked by ``full``
    add_bos = np.full(len(index), bos is not None) & ~(full & (ids_x[starts] == bos))
    add_eos = ~(full & (ids_x[last] == eos))
    eos_loss = (full & loss_x[last]) if completion_only else np.ones(len(index), dtype=bool)
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(add_bos + lengths + add_eos, out=offsets[1:])
    total = int(offsets[-1])
    ids, loss = np.empty(total, dtype=np.int32), np.empty(total, dtype=bool)
    first_at, eos_at = offsets[:-1][add_bos], offsets[1:][add_eos] - 1
    body = np.ones(total, dtype=bool)
    body[first_at], body[eos_at] = False, False
    src = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    ids[body], loss[body] = docs.ids[src], docs.loss[src]
    ids[first_at], loss[first_at] = bos if bos is not None else 0, not completion_only
    ids[eos_at], loss[eos_at] = eos, eos_loss[add_eos]
    return ids, loss, offsets


def _pack(ids: np.ndarray, loss: np.ndarray, width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """The stream cut into rows of ``width`` tokens, the last row right-padded: (rows, loss), (R, width)."""
    n_rows = -(-len(ids) // width)
    rows, rows_loss = np.full(n_rows * width, pad, dtype=np.int32), np.zeros(n_rows * width, dtype=bool)
    rows[: len(ids)], rows_loss[: len(ids)] = ids, loss
    return rows.reshape(n_rows, width), rows_loss.reshape(n_rows, width)


def _pad(
    ids: np.ndarray, loss: np.ndarray, offsets: np.ndarray, width: int, pad: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """One framed document per row, truncated or right-padded to ``width``: (rows, loss, truncated)."""
    lengths = np.diff(offsets)
    keep = np.minimum(lengths, width)
    rows, rows_loss = (
        np.full((len(lengths), width), pad, dtype=np.int32),
        np.zeros((len(lengths), width), dtype=bool),
    )
    row = np.repeat(np.arange(len(lengths)), keep)
    col = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
    src = np.repeat(offsets[:-1], keep) + col
    rows[row, col], rows_loss[row, col] = ids[src], loss[src]
    return rows, rows_loss, int((lengths > width).sum())


@dataclass(frozen=True, slots=True)
class DataStats:
    """What went into a dataset, for the run's log."""

    documents: int  # documents in this split
    tokens: int  # framed tokens (with BOS/EOS), before padding or truncation
    labelled: int  # labels that carry loss, over all kept rows
    rows: int  # rows kept
    truncated: int = 0  # documents cut to seq_len + 1 (packing=False)
    dropped_rows: int = 0  # rows without a single labelled token, left out


class PackedDataset:
    """Rows of ``seq_len + 1`` token ids and their loss flags; batches for training or evaluation."""

    def __init__(self, rows: torch.Tensor, loss: torch.Tensor, stats: DataStats | None = None) -> None:
        if rows.dim() != 2 or rows.shape != loss.shape or rows.shape[1] < 2:
            raise ValueError(
                f"rows {tuple(rows.shape)} and loss {tuple(loss.shape)} must be (N, seq_len + 1)"
            )
        self.rows = rows  # (N, T + 1) int32 token ids
        self.loss = loss  # (N, T + 1) bool: predicting this token carries loss (column 0 is never a target)
        self.stats = stats or DataStats(len(rows), rows.numel(), int(loss[:, 1:].sum()), len(rows))

    @property
    def seq_len(self) -> int:
        return self.rows.shape[1] - 1

    def __len__(self) -> int:
        return self.rows.shape[0]

    def max_token_id(self) -> int:
        return int(self.rows.max()) if len(self) else -1

    def batch(self, index: torch.Tensor) -> Batch:
        """The rows at ``index`` as a Batch: inputs ``row[:-1]``, labels ``row[1:]`` (-100 without loss)."""
        rows = self.rows[index].long()
        labels = rows[:, 1:].masked_fill(~self.loss[index][:, 1:], IGNORE_INDEX)
        return Batch(rows[:, :-1].contiguous(), labels)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Endless training batches; each epoch is a fresh seeded permutation of the rows."""
        if batch_size <= 0 or len(self) == 0:
            raise ConfigError(
                f"cannot batch {len(self)} rows by {batch_size}; need rows and a batch_size > 0"
            )
        gen = torch.Generator().manual_seed(seed)
        order = torch.empty(0, dtype=torch.int64)
        while True:
            while order.numel() < batch_size:
                order = torch.cat([order, torch.randperm(len(self), generator=gen)])
            take, order = order[:batch_size], order[batch_size:]
            yield self.batch(take)

    def one_pass(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in order (the last batch may be smaller): for evaluation."""
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be > 0, got {batch_size}")
        for lo in range(0, len(self), batch_size):
            yield self.batch(torch.arange(lo, min(lo + batch_size, len(self))))

    @classmethod
    def from_documents(
        cls,
        docs: Documents,
        index: np.ndarray,
        tokenizer: Any,
        *,
        seq_len: int,
        packing: bool = True,
        completion_only: bool = False,
    ) -> PackedDataset:
        """Frame, pack (or pad) and keep the rows that carry loss, for the documents in ``index``."""
        ids, loss, offsets = _frame(docs, index, tokenizer, completion_only)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        truncated = 0
        if packing:
            rows, rows_loss = _pack(ids, loss, seq_len + 1, pad)
        else:
            rows, rows_loss, truncated = _pad(ids, loss, offsets, seq_len + 1, pad)
        keep = rows_loss[:, 1:].any(axis=1)
        stats = DataStats(
            documents=len(index),
            tokens=len(ids),
            labelled=int(rows_loss[keep, 1:].sum()),
            rows=int(keep.sum()),
            truncated=truncated,
            dropped_rows=int((~keep).sum()),
        )
        return cls(torch.from_numpy(rows[keep]), torch.from_numpy(rows_loss[keep]), stats)

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Any, seq_len: int) -> PackedDataset:
        """Packed rows of plain texts, every token labelled (the trainer's path until it uses build_datasets)."""
        docs = tokenize_records(((f"text {i}", t) for i, t in enumerate(texts)), "text", tokenizer)
        return cls.from_documents(docs, np.arange(len(docs)), tokenizer, seq_len=seq_len)


def _split_dataset(
    docs: Documents, index: np.ndarray, spec: DataSpec, tokenizer: Any, name: str
) -> PackedDataset:
    ds = PackedDataset.from_documents(
        docs,
        index,
        tokenizer,
        seq_len=spec.seq_len,
        packing=spec.packing,
        completion_only=spec.completion_only,
    )
    if not len(ds):
        why = " (completion_only: none has a completion or an assistant turn)" if spec.completion_only else ""
        raise ConfigError(
            f"the {len(index)} {name} documents of {spec.path} carry no labelled token{why}; "
            "add data, turn completion_only off or change eval_fraction"
        )
    width = spec.seq_len + 1
    if spec.packing and name == "training" and ds.stats.tokens < width:
        raise ConfigError(
            f"the {len(index)} {name} documents of {spec.path} hold {ds.stats.tokens} tokens (with BOS/EOS), "
            f"less than one row of seq_len + 1 = {width}: every batch would be mostly padding; add data "
            f"or lower data.seq_len (to at most {ds.stats.tokens - 1})"
        )
    return ds


def build_datasets(spec: DataSpec, tokenizer: Any) -> tuple[PackedDataset, PackedDataset | None]:
    """(train, eval) from ``spec``: eval is None when ``eval_fraction`` is 0."""
    fmt = detect_format(spec.path, spec.format)
    docs = tokenize_records(
        iter_records(spec.path, fmt), fmt, tokenizer, completion_only=spec.completion_only
    )
    train_idx, eval_idx = split_documents(len(docs), spec.eval_fraction, spec.seed)
    train = _split_dataset(docs, train_idx, spec, tokenizer, "training")
    held_out = _split_dataset(docs, eval_idx, spec, tokenizer, "held-out") if eval_idx.size else None
    return train, held_out
