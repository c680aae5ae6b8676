"""Every hook slidekit calls, prefixed ``slidekit_``.

Two groups. *Driver hooks* yield frozen descriptors (``slidekit.interfaces``):
each implementation may yield any number of them and the core flattens,
validates and indexes the results, so a plugin never needs to know what other
plugins offer. *Lifecycle hooks* tell loggers and tools what the trainer is
doing; their return values are ignored.

Specs only ever gain arguments (pluggy lets an implementation accept a
subset), and ``tests/test_hookspecs.py`` pins every name and signature.

A plugin is any module or object with ``@hookimpl``-decorated functions,
registered through an entry point in group ``slidekit``::

    [project.entry-points.slidekit]
    my_tier = "my_package.my_tier"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from slidekit.interfaces import (
        KernelSetDescriptor,
        ModelAdapterDescriptor,
        OptimizerDescriptor,
        TierDescriptor,
    )

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "slidekit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ============================================================================ drivers


@hookspec
def slidekit_storage_tiers() -> Iterable[TierDescriptor]:
    """Offer storage tiers.

    Called once per plugin manager, when the tier registry is first built.
    Not firstresult: every implementation contributes.

    :return: an iterable (typically a generator) of ``TierDescriptor``.
    """
    raise NotImplementedError


@hookspec
def slidekit_optimizers() -> Iterable[OptimizerDescriptor]:
    """Offer per-unit optimizers.

    Called once per plugin manager, when the optimizer registry is first built.
    Not firstresult.

    :return: an iterable of ``OptimizerDescriptor``.
    """
    raise NotImplementedError


@hookspec
def slidekit_kernel_sets() -> Iterable[KernelSetDescriptor]:
    """Offer kernel sets (RMSNorm, RoPE, SwiGLU, attention, linear + cross-entropy).

    Called once per plugin manager, when the kernel registry is first built.
    Not firstresult.

    :return: an iterable of ``KernelSetDescriptor``.
    """
    raise NotImplementedError


@hookspec
def slidekit_model_adapters() -> Iterable[ModelAdapterDescriptor]:
    """Offer architecture adapters, each serving some Hugging Face ``model_type`` values.

    Called once per plugin manager, when the adapter registry is first built.
    Not firstresult.

    :return: an iterable of ``ModelAdapterDescriptor``.
    """
    raise NotImplementedError


# ============================================================================ lifecycle


@hookspec
def slidekit_fit_start(config: Any, drivers: Mapping[str, str]) -> None:
    """Called once when ``Trainer.fit`` starts, after drivers are selected.

    :param config: the run's ``TrainConfig``.
    :param drivers: family -> selected driver name.
    """


@hookspec
def slidekit_step_end(step: int, metrics: Mapping[str, float]) -> None:
    """Called after every optimizer step has been applied to every unit.

    :param step: 1-based step number.
    :param metrics: at least ``loss``, ``tokens``, ``seconds`` and ``tokens_per_s``.
    """


@hookspec
def slidekit_fit_end(steps: int, error: BaseException | None) -> None:
    """Called once when ``Trainer.fit`` returns or raises.

    :param steps: the number of steps completed.
    :param error: the exception that ended the run, or None on success.
    """
