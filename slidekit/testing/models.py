"""Tiny models and data for tests: one per supported family, written as real Hugging Face directories.

``save_tiny_model`` writes ``config.json`` + ``model.safetensors`` through
transformers itself, with biases and norm weights perturbed away from their
usual 0 / 1 initial values (as in a trained checkpoint), so tests exercise
the same loading path as a user's model and every parameter matters. The
tiny configs set no ``pad_token_id`` unless asked (``pad_token_id=...``); with
one, the padding row of the embedding, which transformers initialises to
zero, is random too, as in a checkpoint whose padding token is its EOS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slidekit.data import Batch

__all__ = ["FAMILIES", "random_batches", "save_tiny_model", "tiny_config"]

#: The families slidekit supports, by Hugging Face model_type.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def tiny_config(family: str, **overrides: Any) -> Any:
    """A small transformers config of ``family``: 3 layers, hidden 64, 4 heads over 2 KV heads."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    values: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "tie_word_embeddings": family == "qwen2",  # as the small Qwen2.5 sizes are
    }
    if family == "llama":
        values["attention_bias"] = True  # exercise the optional biases too
    values.update(overrides)
    return cls(**values)


def save_tiny_model(family: str, directory: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a random tiny model of ``family`` to ``directory`` (safetensors) and return the path."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.05)
        pad = model.get_input_embeddings().padding_idx
        if pad is not None:
            weight = model.get_input_embeddings().weight
            weight[pad] = torch.randn_like(weight[pad]) * config.initializer_range
    model.save_pretrained(directory)
    return directory


def random_batches(
    vocab: int, *, steps: int, batch: int = 2, seq_len: int = 16, seed: int = 0, masked: int = 3
) -> list[Batch]:
    """``steps`` batches of random tokens; the first ``masked`` labels of row 0 are -100."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        labels = ids[:, 1:].clone()
        labels[0, :masked] = -100
        out.append(Batch(ids[:, :-1].contiguous(), labels))
    return out
