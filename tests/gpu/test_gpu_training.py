"""GPU-only: BF16 training against a mixed-precision reference, and device memory flat in depth.

Run on a CUDA machine: ``pytest tests/gpu -s`` (-s shows the memory figures).
"""

from __future__ import annotations

import pytest
import torch

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.testing.asserts import assert_losses_close
from slidekit.testing.models import FAMILIES, random_batches
from slidekit.testing.reference import reference_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("activations", ["device", "ram"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_mixed_precision_reference(family, activations, tiny_model):
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=10, batch=4, seq_len=32)
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-4, weight_decay=0.1),
        engine=EngineConfig(device="cuda", compute_dtype="bfloat16", activation_tier=activations),
        steps=10,
    )
    with Trainer(cfg) as trainer:
        init = trainer.state_dict()
        result = trainer.fit(batches)
    ref = reference_run(
        trainer.hf_config, init, batches, lr=1e-4, weight_decay=0.1, precision="bfloat16", device="cuda"
    )
    assert_losses_close(result.losses, ref.losses, rtol=1e-2)


def _peak_bytes(layers: int) -> int:
    cfg = TrainConfig(
        model=ModelConfig(
            source="demo",
            overrides={
                "num_hidden_layers": layers,
                "hidden_size": 1024,
                "intermediate_size": 2816,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "vocab_size": 2048,
            },
        ),
        data=DataConfig(seq_len=256, batch_size=8),
        optim=OptimConfig(lr=1e-4),
        # The sliding mode with boundary checkpoints: "auto" would keep every layer's graph on a roomy device.
        engine=EngineConfig(device="cuda", activation_tier="ram", gpu_resident="none", recompute="all"),
        steps=3,
    )
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with Trainer(cfg) as trainer:
        trainer.fit()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return peak


def test_peak_device_memory_is_flat_in_depth():
    shallow, deep = _peak_bytes(8), _peak_bytes(16)
    print(
        f"\npeak GPU memory: 8 layers {shallow / 2**20:.1f} MiB, 16 layers {deep / 2**20:.1f} MiB, "
        f"ratio {deep / shallow:.4f}"
    )
    assert deep <= 1.05 * shallow
