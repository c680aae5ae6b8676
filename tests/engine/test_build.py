"""The built engine allocates exactly its ``Layout``: measured bytes against ``Layout.allocations``.

For random configurations (tied and untied models, none / some / all units
resident, keeping their weights or sliding them, optimizer state in RAM or partly streamed from disk, boundary
activations on the device, in RAM or on disk, gradients kept for clipping or
not, both optimizers) the engine is built and trained one step, then
``slidekit.engine.build.footprint`` measures what it holds: the tensors of the
window, the resident units, the masters, the ring, the per-unit gradient
buffers, the speculative-clipping backups, the upload copies (``engine.upload_copy``) and the staging buffers, and each tier's own allocation counter
(state, and the activations the step saved). Every component must equal the
layout's bytes.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.engine.build import footprint
from slidekit.testing.models import random_batches
from slidekit_tiers._files import ALIGN

_counter = itertools.count()

CONFIGS = st.fixed_dictionaries(
    {
        "family": st.sampled_from(["llama", "qwen2"]),
        "resident": st.sampled_from(["none", "0.5", "all"]),
        "weights": st.sampled_from(["keep", "slide"]),
        "offload": st.sampled_from([0.0, 0.5, 1.0]),
        "acts": st.sampled_from(["device", "ram", "posix"]),
        "clip": st.booleans(),
        "clip_overlap": st.sampled_from(["auto", "speculate", "defer"]),
        "optimizer": st.sampled_from(["layer_adam", "adamw_8bit"]),
        "accum": st.integers(1, 2),
        "chunk": st.sampled_from([4096, 1 << 22]),
        "copy": st.sampled_from(["off", "on"]),  # engine.upload_copy (BF16 compute with "on")
    }
)


# Sliding weights beside host units, with a device gradient buffer (clipping) and state partly on disk.
LEAN = {"family": "qwen2", "resident": "0.5", "weights": "slide", "offload": 0.5, "acts": "ram", "clip": True,
        "clip_overlap": "speculate", "optimizer": "adamw_8bit", "accum": 2, "chunk": 4096, "copy": "off"}  # fmt: skip
# Upload copies of the host units beside resident ones, with backups for speculative clipping.
COPIES = {**LEAN, "weights": "keep", "optimizer": "layer_adam", "accum": 1, "copy": "on"}


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=CONFIGS)
@example(cfg=LEAN)
@example(cfg=COPIES)
def test_the_engine_allocates_its_layout(cfg, tiny_model, tmp_path):
    work = tmp_path / f"case{next(_counter)}"
    (work / "off").mkdir(parents=True)
    model = ModelConfig(source=str(tiny_model(cfg["family"])))
    offload = cfg["offload"]
    config = TrainConfig(
        model=model,
        data=DataConfig(batch_size=2, seq_len=16),
        optim=OptimConfig(
            name=cfg["optimizer"],
            lr=1e-3,
            max_grad_norm=1.0 if cfg["clip"] else None,
            clip_overlap=cfg["clip_overlap"],
        ),
        engine=EngineConfig(
            device="cpu",
            compute_dtype="bfloat16" if cfg["copy"] == "on" else "float32",
            gpu_resident=cfg["resident"],
            resident_weights=cfg["weights"],
            upload_copy=cfg["copy"],
            state_offload_tier="posix" if offload else None,
            state_offload_fraction=offload,
            activation_tier=cfg["acts"],
            offload_dir=str(work / "off"),
            state_chunk=cfg["chunk"],
        ),
        grad_accum=cfg["accum"],
        steps=1,
    )
    with Trainer(config) as trainer:
        layout = trainer.engine.layout
        expected = layout.allocations()
        lean = [u.index for u in layout.units if u.weights_slide]
        assert lean == ([u.index for u in layout.units if u.resident] if cfg["weights"] == "slide" else [])
        trainer.fit(random_batches(trainer.spec.vocab_size, steps=cfg["accum"], batch=2, seq_len=16))
        measured = footprint(trainer.engine, trainer._tiers)
        state_buffers = [trainer.engine.host.state.layout(u) for u in range(len(trainer.spec.units))]
    for medium in ("device", "host"):
        for name, nbytes in measured[medium].items():
            want = expected[medium].get(name, 0)
            if medium == "host" and name == "state":
                # the layout counts state on host tiers; measured: the mapped tensors of sliding units
                want = sum(u.state_bytes for u in layout.units if u.slides and u.state_medium == "host")
            assert nbytes == want, f"{medium} {name}: engine {nbytes} B, layout {want} B ({cfg})"
    # Speculative clipping's backups: the master and state of every sliding unit with state in RAM.
    backed = [u for u in layout.units if u.slides and u.state_medium == "host"]
    planned = cfg["clip"] and cfg["clip_overlap"] != "defer" and bool(backed)
    assert layout.clip_backup == planned, cfg
    want_backup = sum(4 * u.numel + u.state_bytes for u in backed) if planned else 0
    assert expected["host"].get("clip backup", 0) == measured["host"].get("clip backup", 0) == want_backup
    # Upload copies: the weights of every sliding unit in BF16 (2 B/param), with "on" only.
    copies = 2 * sum(u.numel for u in layout.units if u.slides) if cfg["copy"] == "on" else 0
    assert layout.upload_copy == bool(copies), cfg
    assert expected["host"].get("upload copies", 0) == measured["host"].get("upload copies", 0) == copies
    assert expected["device"]["staging"] == 0  # the CPU casts no upload through a staging buffer
    per_tier: dict[str, int] = {}
    regions: dict[str, int] = {}
    for u in layout.units:
        per_tier[u.state_tier] = per_tier.get(u.state_tier, 0) + u.state_bytes
        regions[u.state_tier] = regions.get(u.state_tier, 0) + len(state_buffers[u.index])
    if layout.activation_tier != "device":
        name = layout.activation_tier
        per_tier[name] = per_tier.get(name, 0) + layout.activation_bytes
        regions[name] = regions.get(name, 0) + trainer.spec.num_layers * cfg["accum"]
    for name, nbytes in measured["tiers"].items():
        want = per_tier.get(name, 0)
        if name == "posix":
            # a file tier rounds each region's file up to its 4 KiB block: at most a block more per region
            assert want <= nbytes < want + ALIGN * regions[name], f"tier {name}: {nbytes} B, layout {want} B"
        else:
            assert nbytes == want, f"tier {name}: {nbytes} B allocated, layout {per_tier} ({cfg})"
    assert set(per_tier) <= set(measured["tiers"])


def test_a_resident_unit_without_a_device_tier_is_refused(tiny_model):
    """The tier of resident units' state is found by its medium; with none available, a clear error."""
    from slidekit.errors import ConfigError
    from slidekit.plugins import Plugins

    config = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device="cpu", compute_dtype="float32", gpu_resident="all", state_tier="posix"),
    )
    plugins = Plugins(entry_points=["posix", "layer_adam", "torch_ref"])  # no host-memory tier at all
    with pytest.raises(ConfigError, match="no storage tier of the compute device's memory"):
        Trainer(config, plugins=plugins)
