"""Random-weight models shaped like real ones: the published config.json shapes of the models we benchmark.

``PRESETS`` maps a name to the fields of a transformers config (weights are
always random); ``hf_config`` builds the config, ``write_config`` writes it
as a model directory without weights (train it with ``--random-init``), and
``arch_spec`` gives slidekit's ``ArchSpec`` (dimensions and unit layouts)
without allocating a weight. "tiny" is for CPU smoke tests.

Used by ``slidekit bench``, ``benchmarks/train_throughput.py`` and
``benchmarks/e2e_finetune.py``. Test: ``pytest tests/test_bench.py -k preset``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from slidekit.models.base import ArchSpec

__all__ = ["PRESETS", "arch_spec", "hf_config", "preset", "write_config"]


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_type": scaling.pop("rope_type", "default"), "rope_theta": theta, **scaling}


#: Shapes from each model's published config.json (weights are random here). "tiny" is for CPU smoke tests.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
        "rope_parameters": _rope(10000.0),
    },
    "qwen2.5-1.5b": {  # Qwen/Qwen2.5-1.5B
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(1000000.0),
    },
    "qwen2.5-3b": {  # Qwen/Qwen2.5-3B
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(1000000.0),
    },
    "qwen2.5-7b": {  # Qwen/Qwen2.5-7B
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(1000000.0),
    },
    "llama-3.1-8b": {  # meta-llama/Llama-3.1-8B
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _rope(
            500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    },
    "llama-3.1-70b": {  # meta-llama/Llama-3.1-70B
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _rope(
            500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    },
    "qwen2.5-14b": {  # Qwen/Qwen2.5-14B
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": _rope(1000000.0),
    },
    "qwen2.5-32b": {  # Qwen/Qwen2.5-32B
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_hidden_layers": 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,  # as the published GGUF metadata gives it (no effect on memory or time)
        "rope_parameters": _rope(1000000.0),
    },
    "mistral-small-24b": {  # mistralai/Mistral-Small-24B-Base-2501
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,  # not hidden_size / heads (160)
        "max_position_embeddings": 32768,
        "vocab_size": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,  # full attention (MistralConfig's default is a 4096-token window)
        "rope_parameters": _rope(100000000.0),
    },
}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dict(PRESETS[name])


def hf_config(name: str, seq: int) -> Any:
    """The transformers config of preset ``name``, with room for rows of ``seq`` tokens."""
    from transformers import AutoConfig

    values = preset(name)
    model_type = values.pop("model_type")
    values["max_position_embeddings"] = max(seq, values["max_position_embeddings"])
    values["use_cache"] = False
    return AutoConfig.for_model(model_type, **values)


def write_config(name: str, directory: Path, seq: int) -> None:
    """Write preset ``name`` as ``directory/config.json`` (a model directory without weights)."""
    hf_config(name, seq).save_pretrained(directory)


def arch_spec(name: str, seq: int = 4096) -> ArchSpec:
    """slidekit's ArchSpec of preset ``name``, from its adapter: dimensions and layouts, no weights."""
    from slidekit.plugins import Plugins

    config = hf_config(name, seq)
    adapter = Plugins().adapter_for(config.model_type)
    spec: ArchSpec = adapter.descriptor.factory(config)
    return spec
