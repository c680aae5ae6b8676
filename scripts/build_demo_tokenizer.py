"""Rebuild the embedded demo tokenizer from the demo corpus and chat data.

Trains a byte-level BPE tokenizer (vocabulary of 2048 including the special
tokens) on the text of ``slidekit/resources/demo/corpus.jsonl`` and the message
contents of ``slidekit/resources/demo/chat.jsonl``, and writes
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
(with a ChatML chat template) to ``slidekit/resources/demo/tokenizer/``, so that
``transformers.AutoTokenizer.from_pretrained`` can load it offline.

The output is deterministic: running the script twice gives identical files.

Usage (from the repository root):

    python scripts/build_demo_tokenizer.py [--demo-dir slidekit/resources/demo]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_DEMO_DIR = Path(__file__).resolve().parents[1] / "slidekit" / "resources" / "demo"


def iter_texts(demo_dir: Path) -> Iterator[str]:
    """Yield every corpus text and every chat message content, in file order."""
    with (demo_dir / "corpus.jsonl").open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]
    with (demo_dir / "chat.jsonl").open(encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                yield message["content"]


def build_tokenizer(texts: Iterator[str]) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as stable, indented JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    """Train the tokenizer and write its files into ``<demo-dir>/tokenizer``."""
    parser = argparse.ArgumentParser(description="Rebuild the embedded demo tokenizer.")
    parser.add_argument("--demo-dir", type=Path, default=DEFAULT_DEMO_DIR)
    demo_dir: Path = parser.parse_args().demo_dir

    tokenizer = build_tokenizer(iter_texts(demo_dir))
    out_dir = demo_dir / "tokenizer"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    write_json(out_dir / "special_tokens_map.json", special_map)
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special_map,
            "additional_special_tokens": [IM_START, IM_END],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    print(f"wrote {out_dir} (vocab size {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
