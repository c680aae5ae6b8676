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
    from pathlib import Path

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
def slidekit_fit_start(config: Any, drivers: Mapping[str, str], steps_done: int) -> None:
    """Called once when ``Trainer.fit`` starts, after drivers are selected, before the first step.

    A logger starts its run here (``config.run.report_to`` says whether it is asked for, and
    ``slidekit.reporting`` has what loggers share); an exception stops the run before it trains, and
    ``slidekit_fit_end`` is still called, with that error.

    :param config: the run's ``TrainConfig``.
    :param drivers: family -> selected driver name.
    :param steps_done: steps the run has already taken: 0 for a fresh run, the checkpoint's step for a
        resumed one (the first step of this fit is ``steps_done + 1``).
    """


@hookspec
def slidekit_step_end(step: int, metrics: Mapping[str, float]) -> None:
    """Called after every optimizer step has been applied to every unit.

    :param step: 1-based step number.
    :param metrics: at least ``loss``, ``tokens``, ``seconds`` and ``tokens_per_s``.
    """


@hookspec
def slidekit_evaluate(step: int, metrics: Mapping[str, float]) -> None:
    """Called after the held-out set was evaluated (``data.eval_fraction``, ``data.eval_every``), before
    ``slidekit_step_end`` of the same step (whose metrics carry ``eval_loss`` too).

    :param step: the 1-based step after which the model was evaluated.
    :param metrics: ``eval_loss``, the mean cross-entropy over the held-out labelled tokens.
    """


@hookspec
def slidekit_checkpoint_saved(step: int, path: Path) -> None:
    """Called on the training thread once a checkpoint is complete on disk (committed): at the first step
    boundary after it completed, or when ``Trainer.fit`` ends (which waits for every checkpoint).

    :param step: the step whose state the checkpoint holds.
    :param path: the checkpoint's directory (RUN_DIR/checkpoints/step-NNNNNNNN).
    """


@hookspec
def slidekit_fit_end(steps: int, error: BaseException | None) -> None:
    """Called once when ``Trainer.fit`` returns or raises.

    :param steps: the number of steps completed.
    :param error: the exception that ended the run, or None on success.
    """
