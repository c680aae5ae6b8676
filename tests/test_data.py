"""The data pipeline: formats, loss masks, packing and padding, seeded order, held-out split, errors.

Everything runs offline on the demo tokenizer (byte-level BPE, ChatML template, bos/eos/pad).
Expected token ids are built independently, from separate tokenizer calls on the pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slidekit.data import (
    DataSpec,
    PackedDataset,
    build_datasets,
    load_tokenizer,
    read_texts,
    split_documents,
    tokenize_records,
)
from slidekit.errors import ConfigError
from slidekit.models.loading import demo_dir

IGNORE = -100


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(demo_dir() / "tokenizer")


def fresh_tokenizer(template: str | None) -> Any:
    """A demo tokenizer of our own, with another chat template."""
    t = load_tokenizer(demo_dir() / "tokenizer")
    t.chat_template = template
    return t


def ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def write(tmp_path: Path, records: list[Any], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def one_row(
    tmp_path: Path, tok: Any, record: dict, seq_len: int = 64, **kw: Any
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a single record, one document per row."""
    train, _ = build_datasets(
        DataSpec(path=write(tmp_path, [record]), seq_len=seq_len, packing=False, **kw), tok
    )
    assert len(train) == 1
    b = next(train.one_pass(1))
    return b.input_ids[0].tolist(), b.labels[0].tolist()


def padded(tokens: list[int], width: int, fill: int) -> list[int]:
    return tokens + [fill] * (width - len(tokens))


TEXTS = [f"Document number {i} says {'word ' * (i % 7)}and ends." for i in range(23)] + [""]


# ---------------------------------------------------------------------------------------- text and packing


def test_packing_keeps_every_token_once_in_order(tmp_path, tok):
    seq_len = 16
    train, held_out = build_datasets(
        DataSpec(path=write(tmp_path, [{"text": t} for t in TEXTS]), seq_len=seq_len), tok
    )
    assert held_out is None
    stream = [t for text in TEXTS for t in [tok.bos_token_id, *ids(tok, text), tok.eos_token_id]]
    assert train.rows.shape == (-(-len(stream) // (seq_len + 1)), seq_len + 1)
    flat, flat_loss = train.rows.flatten().tolist(), train.loss.flatten().tolist()
    assert flat[: len(stream)] == stream  # nothing lost, nothing repeated, file order
    assert set(flat[len(stream) :]) <= {tok.pad_token_id} and not any(flat_loss[len(stream) :])
    assert all(flat_loss[: len(stream)])
    b = train.batch(torch.arange(len(train)))
    assert b.input_ids.shape == b.labels.shape == (len(train), seq_len)
    assert b.input_ids.dtype == b.labels.dtype == torch.int64
    labelled = b.labels != IGNORE
    assert torch.equal(b.labels[labelled], train.rows[:, 1:].long()[labelled])
    # across a document boundary: last -> EOS and EOS -> BOS are real targets, never last -> next document
    eos_at = (b.input_ids == tok.eos_token_id) & (torch.arange(seq_len) < seq_len - 1)
    assert (b.labels[eos_at] == tok.bos_token_id).all() and eos_at.any()
    assert train.stats.tokens == len(stream) and train.stats.documents == len(TEXTS)


def test_chunked_tokenization_equals_one_document_at_a_time(tok):
    records = [(f"t:{i}", t) for i, t in enumerate(TEXTS)]
    reference = [ids(tok, t) for t in TEXTS]
    for chunk_size in (1, 5, 1024):
        docs = tokenize_records(iter(records), "text", tok, chunk_size=chunk_size)
        assert docs.ids.dtype == np.int32 and len(docs) == len(TEXTS)
        got = [docs.ids[docs.offsets[i] : docs.offsets[i + 1]].tolist() for i in range(len(docs))]
        assert got == reference and docs.loss.all()


def test_padding_mode_one_document_per_row(tmp_path, tok):
    texts = ["short one", "a much longer document " * 10]
    train, _ = build_datasets(
        DataSpec(path=write(tmp_path, [{"text": t} for t in texts]), seq_len=12, packing=False), tok
    )
    short = [tok.bos_token_id, *ids(tok, texts[0]), tok.eos_token_id]
    assert train.rows[0].tolist() == padded(short, 13, tok.pad_token_id)
    assert train.loss[0].tolist() == padded([True] * len(short), 13, False)
    long = [tok.bos_token_id, *ids(tok, texts[1])][:13]  # truncated: its EOS is cut off
    assert train.rows[1].tolist() == long and train.loss[1].all()
    labels = next(train.one_pass(2)).labels
    assert labels[0].tolist() == padded(short[1:], 12, IGNORE)
    assert train.stats.truncated == 1 and train.stats.rows == 2


def test_from_texts(tmp_path, tok):
    path = write(tmp_path, [{"text": t} for t in TEXTS])
    assert read_texts(path) == TEXTS
    rows = PackedDataset.from_texts(read_texts(path), tok, 16)
    assert isinstance(rows, PackedDataset) and rows.rows.shape[1] == 17
    assert rows.rows.flatten()[:3].tolist() == [tok.bos_token_id, *ids(tok, TEXTS[0])[:2]]


# ---------------------------------------------------------------------------------------- loss masks


def test_prompt_completion_mask_exact(tmp_path, tok):
    prompt, completion = "Question: what is two and two?\nAnswer:", " four."
    p, c = ids(tok, prompt), ids(tok, completion)
    x, labels = one_row(tmp_path, tok, {"prompt": prompt, "completion": completion}, completion_only=True)
    assert x == padded([tok.bos_token_id, *p, *c, tok.eos_token_id], 64, tok.pad_token_id)[:64]
    # positions 0..len(p)-1 predict the prompt tokens: no loss; then the completion and its EOS
    assert labels == padded([IGNORE] * len(p) + c + [tok.eos_token_id], 64, IGNORE)
    _, everything = one_row(tmp_path, tok, {"prompt": prompt, "completion": completion})
    assert everything == padded(p + c + [tok.eos_token_id], 64, IGNORE)


def test_packed_completion_only_boundaries(tmp_path, tok):
    recs = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(6)]
    for completion_only in (True, False):
        train, _ = build_datasets(
            DataSpec(path=write(tmp_path, recs), seq_len=8, completion_only=completion_only), tok
        )
        b = train.batch(torch.arange(len(train)))
        before_eos = b.input_ids[b.labels == tok.eos_token_id]
        assert len(before_eos) > 0  # the completion learns to stop ...
        eos_then = b.labels[
            b.input_ids == tok.eos_token_id
        ]  # ... and EOS -> BOS is a target only without masking
        expected = IGNORE if completion_only else tok.bos_token_id
        assert eos_then.numel() > 0 and (eos_then[eos_then != IGNORE] == expected).all()
        if completion_only:
            assert (eos_then == IGNORE).all()
            prompt_ids = {t for r in recs for t in ids(tok, r["prompt"])} - {
                t for r in recs for t in ids(tok, r["completion"])
            }
            assert not (set(b.labels.flatten().tolist()) & prompt_ids)


CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


def chat_expectation(tok: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(tokens, labels) built from separately tokenized pieces: assistant content + <|im_end|> carry loss."""
    tokens, loss = [tok.bos_token_id], [False]
    for m in messages:
        head, body, tail = f"<|im_start|>{m['role']}\n", m["content"], "<|im_end|>"
        learn = m["role"] == "assistant"
        for piece, flag in ((head, False), (body, learn), (tail, learn), ("\n", False)):
            t = ids(tok, piece)
            tokens += t
            loss += [flag] * len(t)
    tokens.append(tok.eos_token_id)
    loss.append(loss[-1])  # EOS carries the loss of the token before it ("\n": none)
    labels = [t if flag else IGNORE for t, flag in zip(tokens[1:], loss[1:], strict=True)]
    return tokens, labels


def test_chat_two_turns_mask_exact(tmp_path, tok):
    messages = [
        {"role": "user", "content": "Hi there, who are you?"},
        {"role": "assistant", "content": "A small model."},
    ]
    rendered = "".join(CHATML.format(**m) for m in messages)
    assert tok.apply_chat_template(messages, tokenize=False) == rendered
    tokens, labels = chat_expectation(tok, messages)
    assert tokens[1:-1] == ids(tok, rendered)  # the pieces tokenize as the whole does
    x, got = one_row(tmp_path, tok, {"messages": messages}, completion_only=True)
    assert x == padded(tokens, 65, tok.pad_token_id)[:64]
    assert got == padded(labels, 64, IGNORE)
    learned = [t for t in got if t != IGNORE]
    assert tok.decode(learned) == "A small model.<|im_end|>"  # content and its end-of-turn token only


def test_chat_multi_turn_with_system(tmp_path, tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, or red."},
    ]
    tokens, labels = chat_expectation(tok, messages)
    _, got = one_row(tmp_path, tok, {"messages": messages}, seq_len=96, completion_only=True)
    assert got == padded(labels, 96, IGNORE)
    assert tok.decode([t for t in got if t != IGNORE]) == "Blue.<|im_end|>Green, or red.<|im_end|>"
    _, everything = one_row(tmp_path, tok, {"messages": messages}, seq_len=96)
    assert everything == padded(tokens[1:], 96, IGNORE)


def learned_text(tmp_path: Path, tokenizer: Any, messages: list[dict]) -> str:
    _, got = one_row(tmp_path, tokenizer, {"messages": messages}, seq_len=96, completion_only=True)
    return tokenizer.decode([t for t in got if t != IGNORE])


CONVERSATION = [
    {"role": "user", "content": "One?"},
    {"role": "assistant", "content": "Yes one."},
    {"role": "user", "content": "Two?"},
    {"role": "assistant", "content": "Yes two."},
]


def test_chat_span_covers_what_the_template_adds_to_a_reply(tmp_path):
    # like Qwen3's empty think block: only the last reply gets a prefix; it is generated, so it is learned
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.last %}{{ '[final] ' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert learned_text(tmp_path, fresh_tokenizer(template), CONVERSATION) == (
        "Yes one.<|im_end|>[final] Yes two.<|im_end|>"
    )


def test_chat_template_whose_generation_prompt_is_not_a_prefix(tmp_path):
    # history says "bot", the generation prompt says "assistant": spans start at the content
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + (m['role'] | replace('assistant', 'bot')) + '\\n' }}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert (
        learned_text(tmp_path, fresh_tokenizer(template), CONVERSATION)
        == "Yes one.<|im_end|>Yes two.<|im_end|>"
    )


def test_chat_template_that_writes_bos_and_eos_is_not_doubled(tmp_path, tok):
    template = (
        "{{ '<|bos|>' }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{{ '<|eos|>' }}"
    )
    x, _ = one_row(tmp_path, fresh_tokenizer(template), {"messages": CONVERSATION[:2]}, completion_only=True)
    assert x.count(tok.bos_token_id) == 1 and x.count(tok.eos_token_id) == 1 and x[0] == tok.bos_token_id


def test_chat_template_that_changes_content_is_refused(tmp_path):
    template = "{% for m in messages %}{{ m['role'] + ': ' + (m['content'] | upper) + '\\n' }}{% endfor %}"
    path = write(tmp_path, [{"messages": CONVERSATION}])
    with pytest.raises(
        ConfigError, match=rf"{path}:1: the chat template does not reproduce assistant message 2"
    ):
        build_datasets(DataSpec(path=path, completion_only=True), fresh_tokenizer(template))
    train, _ = build_datasets(DataSpec(path=path, seq_len=32), fresh_tokenizer(template))  # no masking: fine
    assert len(train) > 0


def test_chat_needs_a_chat_template(tmp_path):
    path = write(tmp_path, [{"messages": CONVERSATION}])
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        build_datasets(DataSpec(path=path), fresh_tokenizer(None))


def test_completion_only_needs_something_to_mask(tmp_path, tok):
    with pytest.raises(ConfigError, match="completion_only needs prompt/completion or chat records"):
        build_datasets(DataSpec(path=write(tmp_path, [{"text": "a"}]), completion_only=True), tok)
    user_only = [{"messages": [{"role": "user", "content": "hello?"}]}] * 3
    with pytest.raises(ConfigError, match="carry no labelled token"):
        build_datasets(DataSpec(path=write(tmp_path, user_only), completion_only=True), tok)


def test_rows_without_labels_are_dropped(tmp_path, tok):
    recs = [{"messages": CONVERSATION[:1]}, {"messages": CONVERSATION[:2]}]
    train, _ = build_datasets(DataSpec(path=write(tmp_path, recs), packing=False, completion_only=True), tok)
    assert len(train) == 1 and train.stats.dropped_rows == 1 and train.stats.documents == 2


# ---------------------------------------------------------------------------------------- order and split


def test_seeded_order_epochs_and_seeds(tmp_path, tok):
    train, _ = build_datasets(DataSpec(path=write(tmp_path, [{"text": t} for t in TEXTS]), seq_len=8), tok)
    n = len(train)
    assert n >= 10

    def first_rows(seed: int, batch_size: int, count: int) -> list[list[int]]:
        it = train.batches(batch_size, seed)
        return [row.tolist() for _ in range(count) for row in next(it).input_ids]

    a, b, c = first_rows(0, 1, 2 * n), first_rows(0, 1, 2 * n), first_rows(1, 1, 2 * n)
    assert a == b and a != c  # the order depends only on the seed
    all_rows = sorted(train.rows[:, :-1].tolist())
    assert sorted(a[:n]) == all_rows and sorted(a[n:]) == all_rows  # each epoch: every row once
    assert a[:n] != a[n:]  # the next epoch reshuffles
    k = (2 * n) // 3
    assert first_rows(0, 3, k) == a[: 3 * k]  # batches spanning an epoch boundary: the same order


def test_split_holds_out_documents_by_seed(tmp_path, tok):
    texts = [f"document {i} is unique" for i in range(40)]
    path = write(tmp_path, [{"text": t} for t in texts])

    def held_out_texts(seed: int) -> tuple[set[str], set[str]]:
        spec = DataSpec(path=path, seq_len=16, packing=False, eval_fraction=0.1, seed=seed)
        train, held_out = build_datasets(spec, tok)
        assert held_out is not None
        batches = list(held_out.one_pass(3))
        assert [len(b.input_ids) for b in batches] == [3, 1]  # one pass, the last batch smaller

        def decode(ds: PackedDataset) -> set[str]:
            return {tok.decode(r[r != tok.pad_token_id].tolist(), skip_special_tokens=True) for r in ds.rows}

        return decode(train), decode(held_out)

    train0, eval0 = held_out_texts(0)
    assert len(eval0) == 4 and not train0 & eval0 and train0 | eval0 == set(texts)
    assert held_out_texts(0) == (train0, eval0)  # stable under the seed
    assert held_out_texts(1)[1] != eval0
    tr, ev = split_documents(40, 0.1, 0)
    assert sorted([*tr, *ev]) == list(range(40)) and len(ev) == 4
    assert len(split_documents(3, 0.01, 0)[1]) == 1  # a positive fraction holds out at least one


# ---------------------------------------------------------------------------------------- malformed input

CHAT_OK = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
BAD_INPUT = [
    ('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', r"d.jsonl:3: not valid JSON"),
    ('{"text": "a"}\n\n["a"]\n', r"d.jsonl:3: expected a JSON object, got an array"),
    (
        '{"text": "a"}\n{"txt": "b"}\n',
        r"d.jsonl:2: expected a str field 'text' \(text records.*got no such field",
    ),
    ('{"text": "a"}\n{"text": 5}\n', r"d.jsonl:2: expected a str field 'text'.*got a number"),
    (
        '{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n',
        r"d.jsonl:2: expected a str field 'completion'",
    ),
    ('{"text": "a"}\n' + json.dumps(CHAT_OK) + "\n", r"d.jsonl:2: expected a str field 'text'"),
    ('{"messages": "hi"}\n', r"d.jsonl:1: expected a list field 'messages'.*got a string"),
    ('{"messages": []}\n', r'd.jsonl:1: "messages" is empty'),
    ('{"messages": ["hi"]}\n', r"d.jsonl:1: message 1 is a string; expected an object"),
    (
        '{"messages": [{"role": "bot", "content": "x"}]}\n',
        r"d.jsonl:1: message 1 has role 'bot'; choose one of: system",
    ),
    (
        '{"messages": [{"role": "user", "content": null}]}\n',
        r'd.jsonl:1: message 1 needs a string "content", got null',
    ),
    (
        '{"text": "a", "messages": []}\n',
        r"d.jsonl:1: cannot tell the record format: it has fields of several",
    ),
    ('{"body": "a"}\n', r"d.jsonl:1: cannot tell the record format: it has fields \['body'\]"),
    ("", r"data file '.*d.jsonl' is empty"),
    ("\n  \n", r"data file '.*d.jsonl' is empty"),
    ('[{"text": "a"}, {"text": "b"}]\n', r"d.jsonl:1: the file is a JSON array, not JSON Lines"),
    ('{\n  "text": "a"\n}\n', r"d.jsonl:1: the first line is not a whole JSON object.*several lines"),
    ("text,label\nhello,1\n", r"d.jsonl:1: the file is not JSON Lines: .*CSV"),
    ('{"text": "a"}\n{"text": "b\n', r"d.jsonl:2: not valid JSON"),
]


@pytest.mark.parametrize(("content", "message"), BAD_INPUT)
def test_malformed_input_names_file_and_line(tmp_path, tok, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as info:
        build_datasets(DataSpec(path=path, seq_len=8), tok)
    assert str(path) in str(info.value)


def test_a_byte_order_mark_is_accepted(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\n')
    train, _ = build_datasets(DataSpec(path=path, seq_len=4), tok)
    assert train.rows[0, 1:].tolist()[: len(ids(tok, "hello"))] == ids(tok, "hello")


def test_missing_and_binary_files(tmp_path, tok):
    with pytest.raises(ConfigError, match="does not exist"):
        build_datasets(DataSpec(path=tmp_path / "nope.jsonl"), tok)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\n\xff\xfe\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2: not UTF-8"):
        build_datasets(DataSpec(path=path), tok)


def test_explicit_format_is_enforced(tmp_path, tok):
    path = write(tmp_path, [{"text": "a"}])
    with pytest.raises(ConfigError, match=r"d.jsonl:1: expected a list field 'messages'"):
        build_datasets(DataSpec(path=path, format="chat"), tok)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"format": "csv"},
            r"data format 'csv' is unknown; choose one of: auto, text, prompt_completion, chat",
        ),
        ({"eval_fraction": 1.0}, r"eval_fraction must be in \[0, 1\), got 1.0"),
        ({"seq_len": 0}, r"seq_len must be > 0"),
    ],
)
def test_spec_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DataSpec(path="x.jsonl", **kwargs)


# ---------------------------------------------------------------------------------------- the demo files


def test_demo_files_load(tok):
    corpus, chat = demo_dir() / "corpus.jsonl", demo_dir() / "chat.jsonl"
    train, held_out = build_datasets(DataSpec(path=corpus, seq_len=64, eval_fraction=0.05), tok)
    assert held_out is not None and held_out.stats.documents == round(0.05 * 256)
    assert train.stats.documents + held_out.stats.documents == 256
    assert 0 <= train.max_token_id() < len(tok)
    train, held_out = build_datasets(
        DataSpec(path=chat, seq_len=128, completion_only=True, eval_fraction=0.05), tok
    )
    assert held_out is not None
    b = next(train.batches(4, seed=0))
    assert b.input_ids.shape == (4, 128)
    learned = b.labels[b.labels != IGNORE]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert learned.numel() > 0 and not (learned == im_start).any()  # no header is ever a target


def test_packed_data_too_small_to_fill_one_row_is_refused(tmp_path, tok):
    path = write(tmp_path, [{"text": "hi"}, {"text": "there"}])
    tokens = 2 + len(ids(tok, "hi")) + 2 + len(ids(tok, "there"))  # each framed as BOS ... EOS
    with pytest.raises(
        ConfigError, match=rf"hold {tokens} tokens .* less than one row of seq_len \+ 1 = 129"
    ):
        build_datasets(DataSpec(path=path, seq_len=128), tok)
    train, _ = build_datasets(DataSpec(path=path, seq_len=tokens - 1), tok)  # exactly one row: fine
    assert len(train) == 1
    train, _ = build_datasets(DataSpec(path=path, seq_len=128, packing=False), tok)  # padded by design
    assert len(train) == 2


# ---------------------------------------------------------------------------------------- reading once


def test_the_data_file_is_hashed_while_it_is_read(tmp_path, tok):
    """Building the datasets reads the file once and leaves its sha256 for the run's identity: after
    the bytes change under the same size and mtime, ``file_sha256`` still gives the bytes that were
    read, so it read nothing itself."""
    import hashlib
    import os

    from slidekit.fingerprint import file_sha256

    path = write(tmp_path, [{"text": t} for t in TEXTS])
    original = path.read_bytes()
    train, _ = build_datasets(DataSpec(path=path, seq_len=16), tok)
    assert len(train)
    st = path.stat()
    path.write_bytes(original.replace(b"Document", b"Dokument"))  # same size, other bytes
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_sha256(path) == "sha256:" + hashlib.sha256(original).hexdigest()
    path.write_bytes(original + b"\n")  # another size: hashed anew
    assert file_sha256(path) == "sha256:" + hashlib.sha256(original + b"\n").hexdigest()


def test_data_paths_expand_the_home_directory(tmp_path, tok, monkeypatch):
    from slidekit.data import data_file, detect_format, iter_records

    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, [{"prompt": "a", "completion": "b"}])
    assert data_file("~/d.jsonl") == tmp_path / "d.jsonl" and data_file(None).name == "corpus.jsonl"
    assert detect_format("~/d.jsonl") == "prompt_completion"
    assert [where for where, _ in iter_records("~/d.jsonl")] == [f"{tmp_path / 'd.jsonl'}:1"]
    train, _ = build_datasets(DataSpec(path="~/d.jsonl", seq_len=3), tok)
    assert len(train) == 1
