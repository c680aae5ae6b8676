"""The loggers of ``run.report_to``: what the trainer checks and what logging plugins share.

A logger is a lifecycle plugin (``slidekit.hookspecs``: ``slidekit_fit_start``, ``slidekit_step_end``,
``slidekit_checkpoint_saved``, ``slidekit_fit_end``) registered under the name ``report_to`` uses for
it, as Hugging Face's ``report_to`` names its integrations. slidekit bundles two, in
``plugins/slidekit_logging``: ``tensorboard`` (event files in RUN_DIR/tensorboard) and ``wandb``
(Weights & Biases, in RUN_DIR/wandb). Every logger plugin is loaded with the others and does nothing
unless the run asks for it:

* ``check_loggers`` (the Trainer, before it builds anything): every name ``report_to`` gives is a
  loaded plugin that implements the lifecycle hooks, or the run is refused naming it;
* ``requested(config, name)``: whether the run asks for logger ``name``, by name or through "all";
* ``import_library``: the logger's library, or, when it is missing, an error naming the extra to
  install (a logger asked for by name) or a warning (one that "all" takes only where installed);
* ``log_dir(config, name)``: where logger ``name`` writes (RUN_DIR/NAME);
* ``scalars(metrics)``: the step metrics a logger shows, under the names it shows them by.

Test: ``pytest tests/test_logging_plugins.py``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from slidekit.errors import ConfigError, DriverUnavailableError

if TYPE_CHECKING:
    from slidekit.plugins import Plugins

__all__ = ["ALL", "BUNDLED", "SCALARS", "check_loggers", "import_library", "log_dir", "requested", "scalars"]

#: The ``report_to`` value that takes every logger whose library is installed.
ALL = "all"
#: The loggers slidekit bundles (plugins/slidekit_logging), by ``report_to`` name.
BUNDLED = ("tensorboard", "wandb")

#: Step metric (``Trainer.fit``'s, as in metrics.jsonl) -> the scalar's name in a logger.
SCALARS: Mapping[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "tflops": "train/tflops",
    "tflops_per_rank": "train/tflops_per_rank",
    "seconds": "train/step_seconds",
    "eval_loss": "eval/loss",
    "gpu_mem_gib": "memory/gpu_mem_gib",
    "host_rss_gib": "memory/host_rss_gib",
    "hiding_factor": "pipeline/hiding_factor",
}

_LIFECYCLE = "slidekit_fit_start"  # a logger starts its run here; a plugin without it logs nothing


def check_loggers(config: Any, plugins: Plugins) -> None:
    """Refuse a name in the run ``config``'s ``report_to`` that no logger plugin loaded in ``plugins``
    answers to (ConfigError naming it)."""
    for name in config.run.report_to:
        if name == ALL:
            continue
        plugin = plugins.pm.get_plugin(name)
        if plugin is None:
            if name in plugins.blocked:
                why = "that plugin is blocked (plugins.block or SLIDEKIT_BLOCK_PLUGINS)"
            else:
                why = (
                    "no plugin of that name is loaded (loggers load through the entry points of group "
                    "'slidekit': is SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD set, or plugins.entry_points narrowed?)"
                )
        elif _LIFECYCLE not in {caller.name for caller in plugins.pm.get_hookcallers(plugin) or ()}:
            why = f"the plugin of that name is not a logger (it implements no {_LIFECYCLE})"
        else:
            continue
        raise ConfigError(
            f"run.report_to (CLI: --report-to) names {name!r}, but {why}; the bundled loggers are "
            f"{', '.join(BUNDLED)}, or give 'none'"
        )


def requested(config: Any, name: str) -> Literal["named", "all"] | None:
    """How the run ``config`` (a TrainConfig) asks for logger ``name``: by name, through "all", or not."""
    report_to = config.run.report_to
    if name in report_to:
        return "named"
    return "all" if ALL in report_to else None


def import_library(config: Any, name: str, module: str, *, extra: str, what: str) -> ModuleType | None:
    """``module``, the library logger ``name`` needs; where it is missing, a ``DriverUnavailableError``
    naming ``pip install 'slidekit[EXTRA]'`` when the run names the logger, and a warning and None when
    it came only through "all" (which takes the loggers that are installed)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        fix = f"pip install 'slidekit[{extra}]'"
        if requested(config, name) == "named":
            raise DriverUnavailableError(
                f"run.report_to names {name!r}, but {what} cannot be imported ({exc}): {fix}, or leave "
                f"{name!r} out of run.report_to (CLI: --report-to)"
            ) from exc
        warnings.warn(
            f"run.report_to 'all': {what} is not installed ({exc}), so the run does not log to it ({fix})",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def log_dir(config: Any, name: str) -> Path:
    """Where logger ``name`` writes for the run ``config``: RUN_DIR/NAME (``report_to`` needs a run.dir)."""
    if not config.run.dir:
        raise ConfigError(f"logger {name!r} writes in the run directory: set run.dir (CLI: --run-dir)")
    return Path(config.run.dir).expanduser() / name


def scalars(metrics: Mapping[str, float]) -> dict[str, float]:
    """The scalars of one step's ``metrics`` a logger shows (``SCALARS``), by the logger's names."""
    return {tag: float(metrics[key]) for key, tag in SCALARS.items() if key in metrics}
