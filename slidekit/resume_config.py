"""``--resume RUN_DIR``: a run directory's saved configuration, with the changes a resume may make.

    slidekit finetune --resume runs/a                    # continue runs/a as its config.json says
    slidekit finetune --resume runs/a --keep 5 --trace runs/a/trace.json
    slidekit finetune --resume runs/a --max-steps 400    # longer: only under a constant learning rate

``resumed_config(run_dir, changes)`` reads ``RUN_DIR/config.json`` (the configuration the run saved
when it started), applies ``changes`` (dotted field -> value: what the command line gave) and, before
anything is built, refuses the changes a resume cannot make, naming each field, why, and the fix.
The rule is ``slidekit.identity``'s, which the checkpoint is checked against again when it is restored:

refused
    what decides which tokens each step sees (``data.split``, ``columns``, ``format``, ``seq_len``,
    ``batch_size``, ``completion_only``, ``packing``, ``eval_fraction``, ``data.seed``, ``grad_accum``,
    ``seed``), the learning rate of each step (``optim.lr``, ``schedule``, ``warmup_steps``,
    ``warmup_ratio``, ``min_lr_ratio``, and ``steps`` under a linear or cosine schedule, whose length it
    is), the optimizer (``optim.name``: the checkpoint holds that optimizer's state) and the weights the
    run started from (``model.random_init``, ``init_seed``, ``overrides``).
allowed, and said to change the arithmetic (maybe)
    ``steps`` under a constant schedule (the run goes on at the same rate), the optimizer's betas, eps,
    weight decay and its exemptions, clipping, ``on_nonfinite``, the device, the compute dtype and the
    kernels: the remaining steps are no longer bitwise the ones the uninterrupted run would take.
    ``model.source`` and ``data.path`` may point elsewhere (their contents are fingerprinted).
allowed
    everything else: tiers, placement, window, buffers, timeouts, threads, checkpoint cadence and
    retention, ``eval_every``, the export, the trace, the loggers (``report_to``), the plugins and
    their drivers' settings (``plugins.options``; an optimizer's may change the arithmetic: said so).

``run.dir`` is RUN_DIR and ``run.resume`` the checkpoint asked for (the newest intact one by default);
``run.overwrite``, which lets an export replace a previous one, is never inherited, only given.
``resume_source`` tells a RUN_DIR from a step or a checkpoint path; ``settings_file`` reads a
``--config`` file, a saved ``config.json`` included.

Test: ``pytest tests/test_config_resume.py tests/test_resume.py``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slidekit import identity as ident
from slidekit.config import TrainConfig, from_dict, load_config
from slidekit.errors import ConfigError
from slidekit.run import saved_config

__all__ = ["REFUSED", "flatten", "resume_source", "resumed_config", "settings_file"]

#: Configuration fields a resume refuses to change beyond what the run's identity holds: they decide
#: the weights the run started from, which the checkpoint fingerprints but the command line cannot.
REFUSED = ("model.random_init", "model.init_seed", "model.overrides")
#: What the run itself sets, never reported as a change.
_SET_HERE = ("run.dir", "run.resume", "run.overwrite")

_TOKENS = "decides which tokens each step sees: the resumed steps would not be the ones the run was taking"
_WHY = {
    "optim.name": "the checkpoint holds this optimizer's state, which another optimizer cannot continue from",
    "optim.lr": "the peak learning rate: every remaining step would take another step size",
    "optim.schedule": "sets the learning rate of every step: the run would leave the curve it is on",
    "optim.min_lr_ratio": "sets the learning rate of every decaying step: the run would leave its curve",
    "seed": "decides the order of the batches: the resumed steps would see other data than the run's",
    "data.seed": "decides the held-out split and the batch order: the resumed steps would see other data",
    "grad_accum": "decides how many rows make one step: the steps would change size",
    "data.split": "picks the records the run reads: the resumed steps would see other data than the run's",
    "data.columns": "maps record fields to columns: the resumed steps would see other data than the run's",
}


def flatten(values: Mapping[str, Any]) -> dict[str, Any]:
    """``{"optim": {"lr": 1e-5}, "steps": 9}`` -> ``{"optim.lr": 1e-5, "steps": 9}`` (one level down)."""
    sections = {k for k, v in TrainConfig().to_dict().items() if isinstance(v, dict)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and key in sections:
            out.update({f"{key}.{name}": v for name, v in value.items()})
        else:
            out[key] = value
    return out


def settings_file(path: str) -> dict[str, Any]:
    """A ``--config`` file's settings. A run's saved ``config.json`` gives its settings, not how that run
    was last started: its ``run.resume`` and ``run.overwrite`` are left out (``--resume RUN_DIR``
    continues that run)."""
    values = load_config(path)
    record = Path(path).expanduser()
    if record.name == "config.json" and saved_config(record.parent) is not None:
        values["run"] = {k: v for k, v in values["run"].items() if k not in ("resume", "overwrite")}
    return values


def resume_source(resume: Any, run_dir: Any) -> tuple[str, bool | str] | None:
    """``--resume X`` where X is a run directory (one holding a slidekit run's config.json), or without
    --run-dir a checkpoint in one's checkpoints/: (that run directory, the resume target). None where X
    is a step, nothing, or (with --run-dir) a checkpoint path: resume in --run-dir as configured."""
    if not isinstance(resume, str) or resume.strip() in ("", "latest") or resume.strip().isdigit():
        return None
    text = resume.strip()
    path = Path(text).expanduser()
    if saved_config(path) is not None:
        same = run_dir is None or os.path.realpath(path) == os.path.realpath(Path(str(run_dir)).expanduser())
        if not same:
            raise ConfigError(
                f"--resume {text} continues the run in {text}, and --run-dir names another directory "
                f"({run_dir}): give --resume {text} alone"
            )
        return text, True
    if run_dir is not None:
        return None
    if path.parent.name == "checkpoints" and saved_config(path.parent.parent) is not None:
        return str(path.parent.parent), text
    what = "does not exist" if not path.exists() else "holds no slidekit run (no config.json saved by one)"
    raise ConfigError(
        f"--resume {text}: {path} {what}; give --resume RUN_DIR (the --run-dir of a run) or a checkpoint "
        "directory in its checkpoints/, or --run-dir RUN_DIR with --resume [STEP|PATH]"
    )


def _put(values: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, name = dotted.rpartition(".")
    (values.setdefault(section, {}) if section else values)[name] = value


def resumed_config(
    run_dir: str | Path, changes: Mapping[str, Any], *, resume: bool | str = True
) -> tuple[TrainConfig, list[str]]:
    """The configuration that continues the run in ``run_dir``: its saved ``config.json`` with
    ``changes`` (dotted field -> value) applied, ``run.dir`` set to ``run_dir`` and ``run.resume`` to
    ``resume``; and the notes to print (what changed, and what that does). ConfigError, naming every
    field, for a change a resume cannot make (see the module docstring) or a directory with no run."""
    path = Path(run_dir).expanduser()
    where = str(path / "config.json")
    saved = saved_config(path)
    if saved is None:
        raise ConfigError(
            f"--resume {run_dir}: {path} holds no slidekit run (no config.json saved by one); give the "
            "--run-dir of a run, a checkpoint directory in one, or --run-dir DIR with --resume [STEP]"
        )
    before = from_dict(saved, where=where)
    merged = copy.deepcopy(before.to_dict())
    for dotted, value in changes.items():
        _put(merged, dotted, value)
    if "epochs" in changes and "steps" not in changes and changes["epochs"] != before.epochs:
        # The saved steps are the count the epochs gave; a new epoch count is counted again from the data
        # (slidekit.data.epochs), as a fresh run's is, or the saved steps would silently win over it.
        _put(merged, "steps", None)
    _put(merged, "run.dir", str(run_dir))
    _put(merged, "run.resume", resume)
    if "run.overwrite" not in changes:
        _put(merged, "run.overwrite", False)
    after = from_dict(merged, where=f"{where} with the command line's changes")
    old, new = flatten(before.to_dict()), flatten(after.to_dict())
    changed = [k for k in new if k not in _SET_HERE and old.get(k) != new[k]]
    refused = _refusals(before, after, changed)
    if refused:
        raise ConfigError(
            f"--resume {run_dir} continues the run saved in {where}, which a resume may not change in: "
            + "; ".join(refused)
            + ". Leave those settings out to keep the saved ones, or start a new run (a new --run-dir)"
        )
    notes = [f"resuming the run in {path} with its saved configuration ({where})"]
    if changed:
        notes.append(
            "changed on the command line: " + "; ".join(_note(k, old[k], new[k], after) for k in changed)
        )
    return after, notes


def _run_identity(config: TrainConfig) -> dict[str, Any]:
    """The part of a run's identity its configuration alone decides."""
    return ident.identity(config.to_dict(), model={}, fingerprints={})


def _refusals(before: TrainConfig, after: TrainConfig, changed: list[str]) -> list[str]:
    """One line per change a resume cannot make: the field, both values, why."""
    was, now = _run_identity(before), _run_identity(after)
    keys = [k for k in ident.FIXED if k in was and was[k] != now.get(k)]
    if "optim.schedule" in keys and "optim.schedule_steps" in keys:
        keys.remove("optim.schedule_steps")  # a schedule of another kind is refused as such
    out = [_refusal(k, was[k], now.get(k), before, after) for k in keys]
    old, new = flatten(before.to_dict()), flatten(after.to_dict())
    out += [
        f"{k}: {old[k]!r} -> {new[k]!r} (decides the weights the run started from)"
        for k in REFUSED
        if k in changed
    ]
    return out


def _refusal(key: str, a: Any, b: Any, before: TrainConfig, after: TrainConfig) -> str:
    if key in ("optim.schedule_steps", "optim.warmup_steps") and after.steps is None:
        return (
            f"epochs: {before.epochs!r} -> {after.epochs!r} (the run's {before.steps} steps decide its "
            f"{'warm-up' if key == 'optim.warmup_steps' else before.optim.schedule + ' schedule'}, and another "
            "epoch count would change the learning rate of every remaining step. Only a constant schedule "
            f"without a warm-up ratio may be extended: keep the epochs, or give --max-steps {before.steps})"
        )
    if key == "optim.schedule_steps":
        return (
            f"steps: {a} -> {b} (the {before.optim.schedule} schedule spans the run's {a} steps and the run "
            f"is on that curve; over {b} steps the learning rate of every remaining step would change, a "
            f"jump at the resumed step. Only a constant schedule may be extended: keep --steps {a})"
        )
    if key == "optim.warmup_steps":
        ratio = after.optim.warmup_ratio
        cause = f"; here warmup_ratio {ratio:g} of steps {before.steps} -> {after.steps}" if ratio else ""
        return (
            f"the warm-up: {a} -> {b} steps (optim.warmup_steps, or warmup_ratio x steps{cause}: the warm-up "
            "sets the learning rate of the first steps, and the run would leave its curve)"
        )
    if key == "optim.name":
        return (
            f"optim.name: {a!r} -> {b!r} ({_WHY[key]}: keep --optimizer {a}, or start a new run from an "
            "export of this one's weights)"
        )
    return f"{key}: {a!r} -> {b!r} ({_WHY.get(key, _TOKENS)})"


def _note(key: str, a: Any, b: Any, after: TrainConfig) -> str:
    line = f"{key} {a!r} -> {b!r}"
    if key == "steps" and b is None:  # a new epoch count: its own note says what happens
        return f"steps {a!r}: counted again from the epochs"
    if key == "steps":  # only a constant schedule gets here (identity's optim.schedule_steps)
        return (
            f"{line} (the learning rate is constant after the warm-up: the run goes on at the same rate "
            f"and ends after step {b})"
        )
    if key == "epochs":
        return (
            f"{line} (the run's length is counted again from the data: epochs x steps per epoch; the learning "
            "rate is constant after the warm-up, so the run goes on at the same rate)"
        )
    if key == "plugins.options":
        return f"{line} (drivers' settings: an optimizer's may change the arithmetic of the remaining steps)"
    if key in ident.NOTED and key not in ("model.source", "data.path"):
        return f"{line} (may change the arithmetic: the rest of the run need not be bitwise the uninterrupted run)"
    return line
