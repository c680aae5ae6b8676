"""From a configuration to the concrete pieces of a run, before anything is allocated.

``resolve(config, plugins)`` picks the device and compute dtype, reads the
model's config.json, finds its adapter (the ``ArchSpec``), and selects every
driver the configuration names (explicit names must be available; "auto"
says what it chose). The trainer builds a run from it; ``slidekit plan``
plans one from it without loading a single weight. ``resolve_spec`` is its
model part alone (``slidekit.planning.what_if`` plans with it for a GPU this
machine lacks).

Test: ``pytest tests/test_planner.py tests/test_plugins.py tests/test_capabilities.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slidekit.capabilities import check_optimizer
from slidekit.config import TrainConfig
from slidekit.devices import device_family, resolve_device
from slidekit.errors import ConfigError, ModelLoadError
from slidekit.interfaces import OptimizerHyper, UnitOptimizer
from slidekit.models.base import ArchSpec
from slidekit.models.loading import load_hf_config
from slidekit.plugins import Plugins, Selection, driver_options

__all__ = ["RunSetup", "build_optimizer", "compute_dtype", "resolve", "resolve_device", "resolve_spec"]


@dataclass(frozen=True, slots=True)
class RunSetup:
    device: torch.device
    family: str  # "cpu", "cuda" or "rocm"
    compute_dtype: torch.dtype
    hf_config: Any
    model_dir: Path
    spec: ArchSpec
    selections: dict[str, Selection]  # kernels, optimizer, state_tier[, activation_tier, state_offload_tier]

    @property
    def itemsize(self) -> int:
        return self.compute_dtype.itemsize


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """``engine.compute_dtype``: "auto" is BF16 on an accelerator and FP32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def resolve(config: TrainConfig, plugins: Plugins) -> RunSetup:
    """Device, dtype, model spec and drivers of ``config`` (errors name what is missing and the fix)."""
    ec = config.engine
    device = resolve_device(ec.device)
    family = device_family(device)
    spec, hf_config, model_dir = resolve_spec(config, plugins)
    selections = {
        "kernels": plugins.select("kernels", ec.kernels, family),
        "optimizer": plugins.select("optimizer", config.optim.name, family),
        "state_tier": plugins.select("tier", ec.state_tier, family),
    }
    if ec.activation_tier not in ("device", "auto"):  # "auto": the engine builder selects the one chosen
        selections["activation_tier"] = plugins.select("tier", ec.activation_tier, family)
    if ec.state_offload_fraction > 0 and ec.state_offload_tier:
        selections["state_offload_tier"] = plugins.select("tier", ec.state_offload_tier, family)
    plugins.check_options(config.plugins.options)  # before anything is built
    return RunSetup(
        device=device,
        family=family,
        compute_dtype=compute_dtype(ec.compute_dtype, device),
        hf_config=hf_config,
        model_dir=model_dir,
        spec=spec,
        selections=selections,
    )


def resolve_spec(config: TrainConfig, plugins: Plugins) -> tuple[ArchSpec, Any, Path]:
    """The model's ``ArchSpec``, its Hugging Face config and its directory, read from its config.json
    (``model.overrides`` applied) without loading a weight. An adapter that refuses the shape is a
    ConfigError naming the overrides where there are any, else a ModelLoadError naming the model."""
    hf_config, model_dir = load_hf_config(config.model.source, config.model.overrides)
    adapter = plugins.adapter_for(hf_config.model_type)
    try:
        spec: ArchSpec = adapter.descriptor.factory(hf_config)
    except ValueError as exc:  # the adapter refuses the shape: say whose shape it is
        overrides = config.model.overrides
        if overrides:
            raise ConfigError(f"model.overrides {dict(overrides)} make no usable model: {exc}") from exc
        raise ModelLoadError(
            f"{model_dir}: the {hf_config.model_type} adapter refuses this model: {exc}"
        ) from exc
    return spec, hf_config, model_dir


def build_optimizer(config: TrainConfig, setup: RunSetup) -> UnitOptimizer:
    """The selected optimizer driver, built with ``config.optim``'s hyperparameters and its settings
    (``plugins.options``).

    Its capability declarations are checked (``slidekit.capabilities.check_optimizer``):
    a driver that does not declare ``device_update`` and ``linear_state`` as bools, or
    whose ``linear_state = True`` its own ``state_layout`` contradicts, is refused with a
    ``PluginError`` naming the plugin, the attribute and the fix.
    """
    oc = config.optim
    selection = setup.selections["optimizer"]
    hyper = OptimizerHyper(
        betas=oc.betas,
        eps=oc.eps,
        weight_decay=oc.weight_decay,
        threads=oc.threads,
        options=driver_options(selection, config.plugins.options),
    )
    optimizer: UnitOptimizer = selection.descriptor.factory(hyper)
    check_optimizer(optimizer, who=f"optimizer {selection.name!r} (plugin {selection.registered.plugin!r})")
    return optimizer
