"""GPU-only: the planner's device-memory estimate against the measured peak, within 10%.

For models of real layer shapes (a few layers each) and several placements,
two training steps run and ``torch.cuda.max_memory_allocated`` (minus what
was allocated before the trainer) is compared with ``Trainer.estimate``'s
device total. Set ``SLIDEKIT_PLANNER_LOG=FILE`` to append each comparison as
a JSON line (the benchmark record).

Run on a CUDA machine: ``pytest tests/gpu/test_planner_gpu.py -s``.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.testing.models import random_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Layer shapes of real models, fewer layers.
SHAPES = {
    "llama-1b-like": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
        "num_hidden_layers": 8,
        "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b-like": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_hidden_layers": 6,
        "tie_word_embeddings": True,
    },
}

CASES = [
    ("llama-1b-like", 4, 1024, 1, "device", "none"),
    ("llama-1b-like", 4, 1024, 2, "ram", "none"),
    ("llama-1b-like", 8, 1024, 1, "device", "all"),
    ("llama-1b-like", 8, 512, 1, "device", "0.5"),
    ("qwen2.5-1.5b-like", 8, 1024, 1, "device", "none"),
    ("qwen2.5-1.5b-like", 2, 1024, 1, "ram", "none"),
]


@pytest.mark.parametrize(("shape", "batch", "seq", "accum", "acts", "resident"), CASES)
def test_device_estimate_within_10_percent(shape, batch, seq, accum, acts, resident):
    overrides = dict(SHAPES[shape], max_position_embeddings=4096)
    cfg = TrainConfig(
        model=ModelConfig(source="demo", overrides=overrides),
        data=DataConfig(seq_len=seq, batch_size=batch),
        optim=OptimConfig(lr=1e-5),
        engine=EngineConfig(device="cuda", activation_tier=acts, gpu_resident=resident),
        grad_accum=accum,
        steps=2,
    )
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with Trainer(cfg) as trainer:
        estimate = trainer.estimate
        assert estimate is not None
        trainer.fit(random_batches(overrides["vocab_size"], steps=2 * accum, batch=batch, seq_len=seq))
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    predicted = estimate.device_bytes
    error = predicted / measured - 1
    row = {
        "shape": shape,
        "batch": batch,
        "seq": seq,
        "grad_accum": accum,
        "activations": acts,
        "gpu_resident": resident,
        "resident_units": sum(estimate.resident),
        "measured_gib": round(measured / 2**30, 3),
        "predicted_gib": round(predicted / 2**30, 3),
        "error": round(error, 4),
        "parts_gib": {k: round(v / 2**30, 3) for k, v in estimate.device.items()},
    }
    print(json.dumps(row))
    log = os.environ.get("SLIDEKIT_PLANNER_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    assert abs(error) <= 0.10, row
