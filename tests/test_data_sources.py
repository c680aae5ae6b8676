"""Data from where people keep it: Hugging Face datasets (save_to_disk directories, parquet/csv/json files,
a dataset in the local HF cache by name), split and column mapping, and ShareGPT and Alpaca records.

Every source is built here from local files (the HF cache entry too: the layout ``load_dataset`` leaves
after a download, written by datasets' own json builder); nothing touches the network. Records from
a dataset must give exactly the rows and loss masks that the same records give from JSONL.

Test: ``python -m pytest -q tests/test_data_sources.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from slidekit import DataConfig, EngineConfig, TrainConfig, Trainer
from slidekit.cli import main
from slidekit.config import parse_columns
from slidekit.data import DataSpec, PackedDataset, build_datasets, data_fingerprint, load_tokenizer
from slidekit.data.formats import read_records
from slidekit.errors import ConfigError
from slidekit.models.loading import demo_dir

datasets = pytest.importorskip("datasets")

QA = [("What is two plus two?", "Four."), ("Name a colour.", "Blue, for one."), ("Say hi.", "Hi!")] * 4
CHAT = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
SHAREGPT = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in QA]
ALPACA = [
    {"instruction": q, "input": "Be brief." if i % 2 else "", "output": a} for i, (q, a) in enumerate(QA)
]
TEXTS = [{"text": f"Document {i} says {'more ' * (i % 4)}and ends."} for i in range(12)]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(demo_dir() / "tokenizer")


def write(tmp_path: Path, records: list[dict], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def rows(spec: DataSpec, tok: Any) -> PackedDataset:
    train, _ = build_datasets(spec, tok)
    return train


def same(a: PackedDataset, b: PackedDataset) -> bool:
    return torch.equal(a.rows, b.rows) and torch.equal(a.loss, b.loss) and a.stats.tokens == b.stats.tokens


def spec(path: Any, **kw: Any) -> DataSpec:
    return DataSpec(path=path, seq_len=64, packing=False, **kw)


# ---------------------------------------------------------------------------------- ShareGPT and Alpaca


def test_sharegpt_records_are_chat(tmp_path, tok):
    chat = rows(spec(write(tmp_path, CHAT, "chat.jsonl"), completion_only=True), tok)
    share = rows(spec(write(tmp_path, SHAREGPT, "share.jsonl"), completion_only=True), tok)
    assert share.stats.format == "sharegpt" and same(share, chat)
    assert 0 < chat.stats.labelled < chat.stats.tokens  # completion_only kept the loss on the assistant


def test_sharegpt_roles_and_a_system_turn(tmp_path, tok):
    turns = [
        {"from": "system", "value": "Be brief."},
        {"from": "user", "value": "Hi"},
        {"from": "assistant", "value": "Yo"},
    ]
    messages = [
        {"role": r, "content": c} for r, c in (("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo"))
    ]
    a = rows(spec(write(tmp_path, [{"conversations": turns}], "a.jsonl"), completion_only=True), tok)
    b = rows(spec(write(tmp_path, [{"messages": messages}], "b.jsonl"), completion_only=True), tok)
    assert same(a, b)
    bad = write(tmp_path, [{"conversations": [{"from": "tool", "value": "x"}]}], "bad.jsonl")
    with pytest.raises(
        ConfigError,
        match=r"bad\.jsonl:1: turn 1 is from 'tool'; ShareGPT turns are from one of: system, human",
    ):
        rows(spec(bad), tok)


def test_alpaca_records_are_a_user_and_an_assistant_turn(tmp_path, tok):
    alpaca = [
        {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
        {"instruction": "Say hi.", "input": "", "output": "Hi!"},
        {"instruction": "Count to three.", "output": "1, 2, 3"},  # no input at all
        {"instruction": "Name a colour.", "input": None, "output": "Blue"},
    ]
    users = ["Translate to French.\n\nGood morning", "Say hi.", "Count to three.", "Name a colour."]
    chat = [
        {"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": r["output"]}]}
        for u, r in zip(users, alpaca, strict=True)
    ]
    a = rows(spec(write(tmp_path, alpaca, "alpaca.jsonl"), completion_only=True), tok)
    assert a.stats.format == "alpaca" and same(
        a, rows(spec(write(tmp_path, chat, "chat.jsonl"), completion_only=True), tok)
    )
    bad = write(tmp_path, [{"instruction": "x", "input": 3, "output": "y"}], "bad.jsonl")
    with pytest.raises(
        ConfigError, match=r'bad\.jsonl:1: "input" must be a string, null or left out, got a number'
    ):
        rows(spec(bad), tok)
    with pytest.raises(ConfigError, match=r"expected a str field 'output' \(alpaca records"):
        rows(spec(write(tmp_path, [{"instruction": "x"}], "c.jsonl"), format="alpaca"), tok)


def test_chat_formats_need_a_chat_template(tmp_path):
    plain = load_tokenizer(demo_dir() / "tokenizer")
    plain.chat_template = None
    with pytest.raises(ConfigError, match=r"chat records \(ShareGPT.*no chat template"):
        rows(spec(write(tmp_path, SHAREGPT)), plain)


# -------------------------------------------------------------------------------------------- columns


def test_columns_map_record_fields_onto_columns(tmp_path, tok):
    plain = rows(spec(write(tmp_path, [{"prompt": q, "completion": a} for q, a in QA], "pc.jsonl")), tok)
    renamed = write(
        tmp_path, [{"question": q, "answer": a, "id": i} for i, (q, a) in enumerate(QA)], "qa.jsonl"
    )
    mapped = rows(spec(renamed, columns={"prompt": "question", "completion": "answer"}), tok)
    assert mapped.stats.format == "prompt_completion" and same(mapped, plain)
    with pytest.raises(
        ConfigError, match=r"qa\.jsonl:1: no column 'body', which data.columns reads 'text' from"
    ):
        rows(spec(renamed, columns={"text": "body"}), tok)


def test_the_columns_syntax():
    assert parse_columns("text=body, prompt = question") == {"text": "body", "prompt": "question"}
    assert parse_columns("") == {}
    assert DataConfig(columns="text=body").columns == {"text": "body"}  # the command line's spelling
    for bad, message in (("text", "is not field=column"), ("text=a,text=b", "map 'text' twice")):
        with pytest.raises(ConfigError, match=message):
            parse_columns(bad)
    with pytest.raises(
        ConfigError, match=r"data.columns maps 'body', which is no record field; the fields are text"
    ):
        DataConfig(columns={"body": "text"})


def test_a_jsonl_file_has_no_splits(tmp_path, tok):
    with pytest.raises(ConfigError, match=r"is a JSONL file, which has no split 'test'"):
        rows(spec(write(tmp_path, TEXTS), split="test"), tok)


# ------------------------------------------------------------------------------------- datasets sources


@pytest.mark.parametrize(
    "records", [TEXTS, CHAT, SHAREGPT, ALPACA], ids=["text", "chat", "sharegpt", "alpaca"]
)
def test_a_save_to_disk_directory_gives_what_jsonl_gives(tmp_path, tok, records):
    directory = tmp_path / "ds"
    datasets.Dataset.from_list(records).save_to_disk(str(directory))
    want = rows(spec(write(tmp_path, records), completion_only=records is not TEXTS), tok)
    got = rows(spec(directory, completion_only=records is not TEXTS), tok)
    assert same(got, want)
    with pytest.raises(
        ConfigError, match=r"holds one dataset, not a DatasetDict with splits: it has no split 'test'"
    ):
        rows(spec(directory, split="test"), tok)


def test_a_dataset_dict_split_and_columns(tmp_path, tok):
    directory = tmp_path / "dd"
    bodies = [{"body": r["text"], "n": i} for i, r in enumerate(TEXTS)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(bodies[:3]), "test": datasets.Dataset.from_list(bodies[3:])}
    ).save_to_disk(str(directory))
    got = rows(spec(directory, split="test", columns={"text": "body"}), tok)
    assert got.stats.documents == len(TEXTS) - 3 and got.stats.format == "text"
    assert same(got, rows(spec(write(tmp_path, TEXTS[3:])), tok))
    with pytest.raises(
        ConfigError, match=r"has no split 'validation'; its splits are \['train', 'test'\].*--data-split"
    ):
        rows(spec(directory, split="validation", columns={"text": "body"}), tok)
    with pytest.raises(
        ConfigError, match=r"dd\[test\] \(columns\): cannot tell the record format.*--data-columns"
    ):
        rows(spec(directory, split="test"), tok)


def test_a_bad_row_is_named(tmp_path, tok):
    directory = tmp_path / "ds"
    datasets.Dataset.from_list([{"text": "fine"}, {"text": None}]).save_to_disk(str(directory))
    with pytest.raises(ConfigError, match=r"ds:row 2: expected a str field 'text'"):
        rows(spec(directory), tok)


def test_parquet_csv_and_json_array_files(tmp_path, tok):
    want = rows(spec(write(tmp_path, TEXTS)), tok)
    table = datasets.Dataset.from_list(TEXTS)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    (tmp_path / "d.json").write_text(json.dumps(TEXTS))  # one JSON array: JSONL's reader would refuse it
    for name in ("d.parquet", "d.csv", "d.json"):
        assert same(rows(spec(tmp_path / name), tok), want), name
    (tmp_path / "lines.json").write_text(
        "".join(json.dumps(r) + "\n" for r in TEXTS)
    )  # JSON Lines: our reader
    fmt, _ = read_records(tmp_path / "lines.json")
    assert fmt == "text" and same(rows(spec(tmp_path / "lines.json"), tok), want)
    with pytest.raises(ConfigError, match=r"d\.parquet is one file, which has no split 'test'"):
        rows(spec(tmp_path / "d.parquet", split="test"), tok)


def _cache(
    cache: Path, build: Path, name: str, splits: dict[str, list[dict]], config: str = "default"
) -> None:
    """Put ``name`` in the HF datasets cache ``cache`` as ``load_dataset(name)`` leaves it after a download
    (``<namespace>___<name>/<config>/<version>/<revision>/<name>-<split>.arrow``), built from local files."""
    from datasets.packaged_modules.json.json import Json

    build.mkdir(parents=True)
    files = {}
    for split, records in splits.items():
        files[split] = str(write(build, records, f"{split}.jsonl"))
    builder = Json(
        cache_dir=str(build / "cache"),
        config_name=config,
        data_files=files,
        dataset_name=name.split("/")[-1],
        hash="0" * 40,
    )
    builder.download_and_prepare()
    namespace, _, short = name.rpartition("/")
    target = cache / (f"{namespace}___{short}" if namespace else short) / config / "0.0.0" / ("0" * 40)
    target.parent.mkdir(parents=True)
    shutil.move(builder.cache_dir, target)


def test_a_dataset_in_the_local_cache_by_name(tmp_path, tok, monkeypatch):
    cache = tmp_path / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the hub path of load_dataset was taken")

    monkeypatch.setattr(datasets, "load_dataset", no_download)
    _cache(cache, tmp_path / "build", "local/tiny-qa", {"train": SHAREGPT[:6], "test": SHAREGPT[6:]})
    got = rows(spec("hf:local/tiny-qa", split="test", completion_only=True), tok)
    assert same(got, rows(spec(write(tmp_path, SHAREGPT[6:]), completion_only=True), tok))
    assert rows(spec("hf:local/tiny-qa", completion_only=True), tok).stats.documents == 6
    with pytest.raises(ConfigError, match=r"no split 'validation'; its splits are \['train', 'test'\]"):
        rows(spec("hf:local/tiny-qa", split="validation"), tok)
    with pytest.raises(
        ConfigError,
        match=r"'hf:local/elsewhere': the dataset is not in the local Hugging Face cache .*never downloads",
    ):
        rows(spec("hf:local/elsewhere"), tok)
    with pytest.raises(ConfigError, match=r"is not hf:NAME or hf:NAME:CONFIG"):
        rows(spec("hf:a/b/c"), tok)
    assert data_fingerprint("hf:local/tiny-qa", "test") not in (None, data_fingerprint("hf:local/tiny-qa"))


def test_a_configuration_of_a_cached_dataset(tmp_path, tok, monkeypatch):
    cache = tmp_path / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    _cache(cache, tmp_path / "b1", "local/multi", {"train": TEXTS[:4]}, config="small")
    _cache(cache, tmp_path / "b2", "local/multi", {"train": TEXTS}, config="large")
    assert rows(spec("hf:local/multi:large"), tok).stats.documents == len(TEXTS)
    assert rows(spec("hf:local/multi:small"), tok).stats.documents == 4
    with pytest.raises(
        ConfigError,
        match=r"multiple 'local/multi' configurations in the cache: (large, small|small, large); pick one: hf:local/multi:CONFIG",
    ):
        rows(spec("hf:local/multi"), tok)


def test_without_datasets_the_error_names_the_extra(tmp_path, tok, monkeypatch):
    directory = tmp_path / "ds"
    datasets.Dataset.from_list(TEXTS).save_to_disk(str(directory))
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without it gives
    with pytest.raises(
        ConfigError,
        match=r"read with Hugging Face datasets, which is not installed.*pip install 'slidekit\[hf\]'",
    ):
        rows(spec(directory), tok)
    assert rows(spec(write(tmp_path, TEXTS)), tok).stats.documents == len(TEXTS)  # JSONL needs no datasets


def test_a_datasets_fingerprint_follows_its_bytes(tmp_path):
    directory = tmp_path / "ds"
    datasets.Dataset.from_list(TEXTS).save_to_disk(str(directory))
    before = data_fingerprint(str(directory))
    assert before is not None and before == data_fingerprint(str(directory))
    shutil.rmtree(directory)
    datasets.Dataset.from_list(TEXTS[:-1]).save_to_disk(str(directory))
    assert data_fingerprint(str(directory)) != before


def test_finetune_on_a_dataset_directory(tmp_path, capsys):
    directory = tmp_path / "ds"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"q": q, "a": a} for q, a in QA])}
    ).save_to_disk(str(directory))
    argv = [
        "finetune",
        "--data",
        str(directory),
        "--data-split",
        "train",
        "--data-columns",
        "prompt=q,completion=a",
    ]
    argv += [
        "--completion-only",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--device",
        "cpu",
        "--quiet",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[1] == f"data: {directory} (prompt_completion, completion_only, packed into rows of 16 + 1 tokens)"
    )
    assert out[-1].startswith("done: 2 steps in ")
    cfg = TrainConfig(
        data=DataConfig(
            path=str(directory), columns={"prompt": "q", "completion": "a"}, seq_len=16, batch_size=2
        ),
        engine=EngineConfig(device="cpu"),
        steps=1,
    )
    with Trainer(cfg) as t:
        assert t.identity()["data.file"] == data_fingerprint(str(directory))
