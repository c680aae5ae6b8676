"""Tokenizing records into flat arrays of token ids and loss flags, the loss mask included.

Each token carries a flag "predicting this token carries loss". Without ``completion_only`` every
token does. With it: for prompt/completion records only the completion tokens (prompt and
completion are tokenized separately, so the boundary is exact and the prompt is tokenized as it will
be at inference); for chat records only the assistant turns. An assistant span starts where the
template's generation prompt ends (``apply_chat_template(messages[:i], add_generation_prompt=True)``,
used when it is a prefix of the whole rendering) and ends after the message's content plus the one
special token right after it, the end-of-turn marker (``<|im_end|>`` in ChatML; the newline after it
carries no loss). When a template is not prefix-stable (it renders earlier turns differently once
later ones exist) the span starts where the content does. Spans are found on characters and mapped
to tokens with the fast tokenizer's offsets; a token straddling the boundary counts as the
assistant's. A template that does not reproduce an assistant's content is refused
(``completion_only`` cannot be honoured there). ShareGPT and Alpaca records arrive as chat messages
(``slidekit.data.formats``) and take the chat path.

``load_tokenizer`` loads only a directory that holds a tokenizer's vocabulary (``VOCAB_FILES``) and
refuses one that encodes text to nothing: transformers builds an *empty* tokenizer (one token, id 0)
from a directory with a config.json of some model types (Qwen2, Qwen3) and no tokenizer files, which
tokenized every document to ``[0]``.

Test: ``python -m pytest -q tests/test_data.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slidekit.data.formats import CHAT_FORMATS
from slidekit.errors import ConfigError

__all__ = ["VOCAB_FILES", "Documents", "has_vocabulary", "load_tokenizer", "tokenize_records"]

#: Files that hold a tokenizer's vocabulary (one is enough): tokenizers' JSON, SentencePiece, BPE, WordPiece,
#: Mistral's tekken. tokenizer_config.json alone holds none.
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)

#: A text every real vocabulary encodes to some tokens.
_PROBE = "Hello world, 12."


def has_vocabulary(directory: str | Path) -> bool:
    """Whether ``directory`` holds one of the ``VOCAB_FILES`` (or a ``*.tiktoken`` file)."""
    path = Path(directory).expanduser()
    return path.is_dir() and (
        any((path / name).is_file() for name in VOCAB_FILES) or any(path.glob("*.tiktoken"))
    )


def load_tokenizer(directory: str | Path, label: str = "") -> Any:
    """The fast tokenizer saved in ``directory`` (offline); ConfigError when there is none or it is empty.
    ``label`` names the directory in errors (e.g. "the model directory")."""
    from transformers import AutoTokenizer

    name = f"{label} {str(directory)!r}" if label else repr(str(directory))
    fix = "pass the directory of the model's tokenizer (CLI: --tokenizer DIR, config: model.tokenizer)"
    if not has_vocabulary(directory):
        raise ConfigError(
            f"{name} holds no tokenizer: none of {', '.join(VOCAB_FILES)}; {fix}, e.g. the base model's"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {name}: {exc}; {fix}") from exc
    if not tokenizer(_PROBE, add_special_tokens=False)["input_ids"]:
        raise ConfigError(f"the tokenizer in {name} encodes text to no token (an empty vocabulary); {fix}")
    return tokenizer


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
    fmt = "chat" if fmt in CHAT_FORMATS else fmt
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
    if fmt in CHAT_FORMATS and not getattr(tokenizer, "chat_template", None):
        what = {"chat": '{"messages": [...]}', "sharegpt": 'ShareGPT, {"conversations": [...]}'}.get(
            fmt, "Alpaca, rendered as a user and an assistant message"
        )
        raise ConfigError(
            f"the data holds chat records ({what}) but the tokenizer has no chat template; use a tokenizer "
            "with one (chat_template in tokenizer_config.json) or write prompt/completion records"
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
