"""Load a model: its Hugging Face config, and its weights into flat FP32 unit vectors.

Sources: ``"demo"`` (the tiny Llama-style model embedded in the package), a
local Hugging Face model directory (``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``), or a directory with only a
config, which starts from random weights when asked to.

Weights stream tensor by tensor from safetensors into the unit masters, so a
model never needs to fit in memory twice. Random initialisation follows
transformers' (normal(0, initializer_range) for matrices, ones for norms, zeros
for biases and for the embedding row of ``pad_token_id``) with one generator
per unit, so it does not depend on order or threads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from slidekit.errors import ModelLoadError
from slidekit.models.base import ArchSpec, UnitLayout

__all__ = [
    "DEMO_MODEL",
    "demo_dir",
    "init_unit",
    "load_hf_config",
    "load_unit_weights",
    "weight_files",
]

DEMO_MODEL = "demo"


def demo_dir() -> Path:
    """The embedded demo assets: model config, tokenizer, sample data."""
    return Path(str(resources.files("slidekit") / "resources" / "demo"))


def load_hf_config(source: str, overrides: Mapping[str, Any] | None = None) -> tuple[Any, Path]:
    """The transformers config of ``source`` (with ``overrides`` applied) and the model directory."""
    from transformers import AutoConfig

    directory = demo_dir() / "model" if source == DEMO_MODEL else Path(source).expanduser()
    if not directory.exists():
        raise ModelLoadError(
            f"model directory {str(directory)!r} does not exist; pass a local Hugging Face "
            f"model directory (config.json + *.safetensors) or {DEMO_MODEL!r}"
        )
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{str(directory)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    if overrides:
        config = _override(config, dict(overrides))
    return config, directory


def _override(config: Any, overrides: dict[str, Any]) -> Any:
    values = config.to_dict()
    unknown = [k for k in overrides if k not in values]
    if unknown:
        raise ModelLoadError(f"cannot override {unknown}: {config.model_type} configs have no such fields")
    values.update(overrides)
    if "num_hidden_layers" in overrides:
        values.pop("layer_types", None)  # derived from the layer count; let the config rebuild it
    return type(config)(**values)


def weight_files(directory: Path) -> dict[str, Path]:
    """Parameter name -> safetensors file holding it; empty when the directory has no weights."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    return {}


def load_unit_weights(unit: UnitLayout, files: Mapping[str, Path], master: torch.Tensor) -> None:
    """Copy one unit's tensors from safetensors into its flat FP32 ``master`` (upcasting)."""
    from safetensors import safe_open

    missing = [e.name for e in unit.entries if e.name not in files]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}; "
            "does the config match the weights?"
        )
    master.zero_()
    by_file: dict[Path, list[Any]] = {}
    for e in unit.entries:
        by_file.setdefault(files[e.name], []).append(e)
    for path, entries in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for e in entries:
                t = f.get_tensor(e.name)
                if tuple(t.shape) != e.shape:
                    raise ModelLoadError(
                        f"{e.name} has shape {tuple(t.shape)} in {path.name}, the config implies {e.shape}"
                    )
                master[e.offset : e.stop].view(e.shape).copy_(t)


def init_unit(spec: ArchSpec, unit: UnitLayout, master: torch.Tensor, seed: int) -> None:
    """Random initialisation of one unit into its flat FP32 ``master``, reproducible per (seed, unit)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + unit.index)
    master.zero_()
    for e in unit.entries:
        view = master[e.offset : e.stop].view(e.shape)
        if e.key.endswith("norm.weight"):
            view.fill_(1.0)
        elif e.key.endswith(".weight"):
            view.normal_(0.0, spec.initializer_range, generator=gen)
            if e.key == "embed_tokens.weight" and spec.pad_token_id is not None:
                view[spec.pad_token_id].zero_()  # as transformers initialises nn.Embedding(padding_idx=...)
        # biases stay zero
