"""The product's promise: where activations and optimizer state live changes speed and memory, never results.

For random tiny models, seeds and placements (activations on the device or
a tier; optimizer state on one tier, a random fraction of units on a second
one; streamed state in random chunk sizes; random window sizes), N training
steps give BITWISE the losses and parameters of the all-RAM run. On the CPU
the tiers are ram, posix (when installed), and ``unmapped_ram`` below: RAM
that refuses to be mapped, so state is streamed through staging buffers
exactly as from a disk. On a GPU the same test adds the device's own
activation store and whatever GPU tiers are available (gds).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.engine.state import GRANULE
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import TierDescriptor
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches, save_tiny_model
from slidekit_tiers.ram import RamTier

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class UnmappedRam(RamTier):
    name = "unmapped_ram"

    def map(self, key):
        return None


class UnmappedPlugin:
    @hookimpl
    def slidekit_storage_tiers(self) -> Iterator[TierDescriptor]:
        yield TierDescriptor(name="unmapped_ram", factory=UnmappedRam)


def _plugins() -> Plugins:
    return Plugins(extra=[("unmapped", UnmappedPlugin())])


def _available_tiers() -> list[str]:
    plugins = _plugins()
    family = "cuda" if DEVICE == "cuda" else "cpu"
    names = []
    for reg in plugins.drivers("tier"):
        if family in reg.descriptor.devices and plugins.availability("tier", reg.name)[0]:
            names.append(reg.name)
    return names


TIERS = _available_tiers()
STATE_TIERS = [t for t in TIERS if t != "gpu"]  # device memory holds the state of resident units only


def _run(model_dir, offload_dir, batches, **engine) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05),
        engine=EngineConfig(
            device=DEVICE, offload_dir=str(offload_dir), **{"gpu_resident": "none", **engine}
        ),
    )
    with Trainer(cfg, plugins=_plugins()) as t:
        result = t.fit(batches)
        return result.losses, t.state_dict()


placements = st.fixed_dictionaries(
    {
        "activation_tier": st.sampled_from(["device", *TIERS]),
        "state_tier": st.sampled_from(STATE_TIERS),
        "state_offload_tier": st.sampled_from(STATE_TIERS),
        "state_offload_fraction": st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0),
        "state_chunk": st.sampled_from([GRANULE, 2 * GRANULE, 1 << 24]),
        "window": st.integers(2, 4),
        "gpu_resident": st.sampled_from(["none", "0.5", "all"]),
    }
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],  # see conftest.py
)
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
    layers=st.integers(1, 3),
    hidden=st.sampled_from([64, 96]),
    seed=st.integers(0, 2**16),
    placement=placements,
)
def test_placement_never_changes_results(tmp_path_factory, family, layers, hidden, seed, placement):
    model_dir = save_tiny_model(
        family,
        tmp_path_factory.mktemp("m"),
        seed=seed,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
    )
    offload = tmp_path_factory.mktemp("offload")
    batches = random_batches(128, steps=3, seed=seed)
    base_losses, base_state = _run(model_dir, offload, batches)  # everything in RAM / on the device
    losses, state = _run(model_dir, offload, batches, **placement)
    assert losses == base_losses
    assert_states_equal(state, base_state)


def test_streamed_state_really_streams_in_chunks(tiny_model, tmp_path):
    """A unit bigger than one chunk goes through several chunks (and still matches bitwise)."""
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=2)
    base = _run(model_dir, tmp_path, batches)
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05),
        engine=EngineConfig(
            device=DEVICE, state_tier="unmapped_ram", state_chunk=GRANULE, gpu_resident="none"
        ),
    )
    with Trainer(cfg, plugins=_plugins()) as t:
        store = t.engine.host.state
        assert all(store.streamed(u.index) for u in t.spec.units)
        assert max(u.numel for u in t.spec.units) > 2 * store.chunk  # several chunks per layer
        result = t.fit(batches)
        assert result.losses == base[0]
        assert_states_equal(t.state_dict(), base[1])


def test_offload_fraction_places_units_evenly(tiny_model, tmp_path):
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(
            device=DEVICE, state_offload_tier="unmapped_ram", state_offload_fraction=0.4, gpu_resident="none"
        ),
    )
    with Trainer(cfg, plugins=_plugins()) as t:
        streamed = [t.engine.host.state.streamed(u.index) for u in t.spec.units]
    assert streamed.count(True) == 2 and len(streamed) == 5  # round(0.4 * 5)


def test_unknown_offload_tier_is_refused(tiny_model):
    from slidekit.errors import UnknownDriverError

    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device=DEVICE, state_offload_tier="tape", state_offload_fraction=0.5),
    )
    with pytest.raises(UnknownDriverError, match="unknown storage tier 'tape'"):
        Trainer(cfg)


class TinyDisk(RamTier):
    """A tier that reports 1 MiB free."""

    name = "tiny_disk"

    def stats(self):
        from dataclasses import replace

        return replace(super().stats(), capacity=1 << 20)


class TinyDiskPlugin:
    @hookimpl
    def slidekit_storage_tiers(self) -> Iterator[TierDescriptor]:
        yield TierDescriptor(name="tiny_disk", factory=TinyDisk)


def test_a_placement_that_does_not_fit_is_refused_before_training(tiny_model, tmp_path):
    from slidekit import DataConfig
    from slidekit.errors import ConfigError

    plugins = Plugins(extra=[("tiny", TinyDiskPlugin())])
    model_dir = tiny_model("llama", hidden_size=256, intermediate_size=512)  # ~1 M state bytes per layer
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        engine=EngineConfig(
            device=DEVICE, state_tier="tiny_disk", offload_dir=str(tmp_path), gpu_resident="none"
        ),
    )
    with pytest.raises(ConfigError, match=r"storage tier 'tiny_disk' in .* needs .* GiB \(optimizer state"):
        Trainer(cfg, plugins=plugins)
    # Activations alone can overflow it too: 64 rows x 512 tokens x 256 x 4 bytes x 3 layers.
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        data=DataConfig(batch_size=64, seq_len=512),
        # Every layer saves its boundary (on a roomy device "auto" would keep graphs there instead).
        engine=EngineConfig(device=DEVICE, activation_tier="tiny_disk", gpu_resident="none", recompute="all"),
    )
    with pytest.raises(ConfigError, match="activations"):
        Trainer(cfg, plugins=plugins)
