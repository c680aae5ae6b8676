"""Training data: records, tokenized, loss-masked, packed (or padded) into rows, split, batched.

The package, by concern: ``formats`` (records of a JSONL file; ShareGPT and Alpaca mapped to chat),
``hub`` (Hugging Face datasets sources, the optional extra ``slidekit[hf]``), ``sources`` (which
reader a path takes), ``tokens`` (the tokenizer, token ids and the loss mask), ``packing`` (framing,
rows, the held-out split), ``datasets`` (datasets and batches, ``Batch`` and its label convention),
``epochs`` (the run's step count), ``summary`` (what the run prints about its data), ``configured``
(all of it for a ``TrainConfig``). The user's guide is docs/data.md.

Formats (one JSON object per line, or one row of a dataset; detected from the first record, or a
dataset's columns, then required on every record)::

    {"text": "..."}                                    plain text: every token carries loss
    {"prompt": "...", "completion": "..."}             prompt, then completion (no separator added)
    {"messages": [{"role": "user", "content": "..."}, ...]}   rendered by the tokenizer's chat template
    {"conversations": [{"from": "human", "value": "..."}, ...]}   ShareGPT, mapped to chat
    {"instruction": "...", "input": "...", "output": "..."}       Alpaca, mapped to chat

Roles are "system", "user" and "assistant"; other fields of a record are ignored. Malformed input
raises ``ConfigError`` naming ``file:line`` (or ``source:row N``) and what was expected.

Labels. ``Batch`` labels are already shifted: ``labels[b, t]`` is the token after ``input_ids[b, t]``.
Hugging Face-style batches (``labels == input_ids``, the model shifts) go through ``Batch.from_hf``;
a Batch built from them directly is refused (it would train the model to copy its input).

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

Test: ``python -m pytest -q tests/test_data.py tests/test_data_sources.py tests/test_data_summary.py
tests/test_epochs.py tests/test_hf_labels.py``.
"""

from __future__ import annotations

from slidekit.data.datasets import Batch, DataSpec, DataStats, PackedDataset, build_datasets
from slidekit.data.epochs import StepCount, count_steps, steps_per_epoch
from slidekit.data.formats import FORMATS, data_file, detect_format, iter_records, read_records, read_texts
from slidekit.data.packing import split_documents
from slidekit.data.sources import data_fingerprint, is_datasets_source, open_records
from slidekit.data.summary import describe_data
from slidekit.data.tokens import Documents, has_vocabulary, load_tokenizer, tokenize_records

__all__ = [
    "FORMATS",
    "Batch",
    "DataSpec",
    "DataStats",
    "Documents",
    "PackedDataset",
    "StepCount",
    "build_datasets",
    "count_steps",
    "data_file",
    "data_fingerprint",
    "describe_data",
    "detect_format",
    "has_vocabulary",
    "is_datasets_source",
    "iter_records",
    "load_tokenizer",
    "open_records",
    "read_records",
    "read_texts",
    "split_documents",
    "steps_per_epoch",
    "tokenize_records",
]
