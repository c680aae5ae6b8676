"""Export a fine-tuned model as a Hugging Face model directory.

    OUT/
      config.json                         the model's config (torch_dtype set to the export dtype)
      model.safetensors                   or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      tokenizer.json, tokenizer_config.json, ...   when the source model had a tokenizer

``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it. Tensors
are written one shard at a time (at most ``shard_bytes`` each) from the FP32
masters, so an export needs about one shard of extra memory. The directory
is assembled beside OUT (``.OUT.export-<pid>-XXXXXXXX``, owned while it is
written: ``slidekit.owned``) and renamed into place: a failed export never
leaves a half-written model where a good one is expected, and what a killed
export leaves is removed by the next run's start (``leftover_prefix``).

Test: ``pytest tests/test_export.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from slidekit.errors import ConfigError
from slidekit.owned import OwnedDir

__all__ = ["export_model", "leftover_prefix"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _shards(
    state: Mapping[str, torch.Tensor], dtype: torch.dtype, limit: int
) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * torch.empty((), dtype=dtype).element_size()
        if shard and size + nbytes > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = t.to(dtype).contiguous()
        size += nbytes
    if shard:
        yield shard


def leftover_prefix(out: str | os.PathLike[str]) -> str:
    """The name prefix of the directories an export to ``out`` assembles beside it (``slidekit.owned``)."""
    return f".{Path(out).expanduser().name}.export-"


def export_model(
    out: str | os.PathLike[str],
    *,
    hf_config: Any,
    state: Mapping[str, torch.Tensor],
    tokenizer: Any | None,
    dtype: str = "bfloat16",
    shard_bytes: int = 5 << 30,
    overwrite: bool = False,
) -> Path:
    """Write ``state`` (Hugging Face names -> FP32 tensors) with ``hf_config`` and ``tokenizer`` to ``out``."""
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ConfigError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    target = Path(out).expanduser()
    if target.exists() and not overwrite:
        raise ConfigError(f"{target} already exists; choose another directory or allow overwriting")
    target.parent.mkdir(parents=True, exist_ok=True)
    owned = OwnedDir.create(target.parent, leftover_prefix(target))
    tmp = Path(owned.path)
    try:
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        tensors = {n: t for n, t in state.items() if not (tied and n == "lm_head.weight")}
        shards = list(_shards(tensors, _DTYPES[dtype], shard_bytes))
        names = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        )
        weight_map, total = {}, 0
        for fname, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            for n, t in shard.items():
                weight_map[n] = fname
                total += t.numel() * t.element_size()
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf_config.torch_dtype = dtype
        hf_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        owned.disown()  # the model directory must not carry the .owner file
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        owned.release()
    return target
