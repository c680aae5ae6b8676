"""A run's identity: what a resume may not change, and what it may.

Every checkpoint records the identity of the run that wrote it (``meta.json``, key ``"identity"``).
A resume compares it with its own and refuses, naming each field and both values, any change to
what decides which tokens a step sees, which update it applies, or what it starts from
(``FIXED``):

    model.weights           fingerprint of the initial weights (``slidekit.fingerprint``); the model
                            directory may move, its weights may not change
    model.tokenizer         fingerprint of the tokenizer files
    model.<architecture>    model_type, layers, params, hidden_size, intermediate_size, heads, kv_heads,
                            head_dim, vocab_size, rms_eps, tie_embeddings, sliding_window, flags, rope
    data.file               sha256 of the training data (a file, or a dataset's files: its path may change, its bytes may not)
    data.split, data.columns
                            which split of a dataset the run reads, and which column each record
                            field is read from (same bytes, other records)
    data.format, data.seq_len, data.batch_size, data.completion_only, data.packing,
    data.eval_fraction, data.seed, grad_accum, seed
                            (grad_accum with the data-parallel world size: what a resume keeps is the
                            step's batch, ranks x grad_accum; on another world size, re-sharded, it
                            keeps it with grad_accum x old ranks / new ranks micro-batches a rank)
    optim.name              the optimizer (its state would not fit another's anyway)
    optim.lr                the peak learning rate, as used (the model's default when unset)
    optim.schedule, optim.warmup_steps, optim.min_lr_ratio
                            (warmup_steps as used: an ``optim.warmup_ratio`` is resolved into steps)
    optim.schedule_steps    the schedule's length: ``steps`` for linear and cosine; a constant schedule
                            has no length, so a constant-rate run may be extended with more steps

Everything else may change on resume. Tiers and placement (state tier, offload fraction, activation
tier, GPU residency, window, buffers) leave every bit of the result unchanged by design; logging,
tracing, checkpoint cadence and retention, the export, the run directory's other settings and the
plugins have nothing to do with the arithmetic. The few allowed changes that do alter the
arithmetic, an intervention a person makes on purpose (``NOTED``: the optimizer's betas, eps,
weight decay and its exemptions, clipping, the policy for non-finite steps, the device, precision
and kernels, and steps, data.path and model.source where they are allowed to differ), are listed in a
note when the run resumes. A checkpoint from a slidekit that recorded no fingerprints is resumed with
a warning naming the fields that could not be checked. A field added after checkpoints began
recording identities (``ADDED``: data.split, data.columns) is taken, where a checkpoint lacks it,
from the configuration it recorded, or else is the default every run had before the setting existed.

Test: ``pytest tests/test_identity.py``.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.config import DEFAULT_LR, DEMO_LR

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.models.base import ArchSpec

__all__ = [
    "ADDED",
    "FIXED",
    "NOTED",
    "architecture",
    "changed_settings",
    "completed",
    "differences",
    "effective_lr",
    "identity",
    "run_identity",
    "step_batch_change",
]

#: Configuration fields a resume must keep (dotted paths into ``TrainConfig.to_dict()``).
_CONFIG_FIXED = (
    "data.split",
    "data.columns",
    "data.format",
    "data.seq_len",
    "data.batch_size",
    "data.completion_only",
    "data.packing",
    "data.eval_fraction",
    "data.seed",
    "grad_accum",
    "seed",
    "optim.name",
    "optim.schedule",
    "optim.warmup_steps",
    "optim.min_lr_ratio",
)
_ARCH = (
    "model_type",
    "layers",
    "params",
    "hidden_size",
    "intermediate_size",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab_size",
    "rms_eps",
    "tie_embeddings",
    "sliding_window",
    "flags",
    "rope",
)
#: Every identity field a resume must keep.
FIXED = (
    "model.weights",
    "model.tokenizer",
    *(f"model.{k}" for k in _ARCH),
    "data.file",
    *_CONFIG_FIXED,
    "optim.lr",
    "optim.schedule_steps",
)
#: Identity fields added after checkpoints began recording an identity, with the value every run had
#: before the setting existed: what a checkpoint that lacks one (and whose configuration lacks it) ran with.
ADDED: Mapping[str, Any] = {"data.split": "train", "data.columns": {}}
#: Configuration fields a resume may change that alter the arithmetic: changes are listed in a note.
NOTED = (
    "model.source",
    "data.path",
    "steps",
    "optim.betas",
    "optim.eps",
    "optim.weight_decay",
    "optim.no_decay",
    "optim.max_grad_norm",
    "optim.on_nonfinite",
    "engine.device",
    "engine.compute_dtype",
    "engine.kernels",
)


def _get(config: Mapping[str, Any], dotted: str) -> Any:
    section, _, name = dotted.rpartition(".")
    table = config.get(section, {}) if section else config
    return table.get(name) if isinstance(table, Mapping) else None


def effective_lr(source: str, lr: float | None) -> float:
    """The peak learning rate a run uses: ``optim.lr``, or the default for its model when unset."""
    if lr is not None:
        return lr
    return DEMO_LR if source == "demo" else DEFAULT_LR


def architecture(spec: ArchSpec) -> dict[str, Any]:
    """The identity fields of a model's architecture (``model.<name>``)."""
    inv_freq, scaling = spec.rope_init()
    rope = hashlib.sha256(
        inv_freq.detach().cpu().double().numpy().tobytes() + repr(float(scaling)).encode()
    ).hexdigest()
    values = {
        "model_type": spec.model_type,
        "layers": spec.num_layers,
        "params": spec.num_params,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_eps": spec.rms_eps,
        "tie_embeddings": spec.tie_embeddings,
        "sliding_window": spec.sliding_window,
        "flags": asdict(spec.flags),
        "rope": "sha256:" + rope,
    }
    return {f"model.{k}": values[k] for k in _ARCH}


def identity(
    config: Mapping[str, Any], *, model: Mapping[str, Any], fingerprints: Mapping[str, str | None]
) -> dict[str, Any]:
    """The identity of a run: ``config`` is ``TrainConfig.to_dict()``, ``model`` its ``architecture``
    fields (or a part of them), ``fingerprints`` any of model.weights, model.tokenizer and data.file."""
    out: dict[str, Any] = dict(model)
    out.update(fingerprints)
    for dotted in _CONFIG_FIXED:
        out[dotted] = _get(config, dotted)
    out = completed(out, {})  # a configuration from before a setting existed ran with its default
    ratio = _get(config, "optim.warmup_ratio") or 0.0
    if ratio and not out["optim.warmup_steps"]:  # the warm-up as used (OptimConfig.warmup)
        out["optim.warmup_steps"] = math.ceil((_get(config, "steps") or 0) * ratio)
    out["optim.lr"] = effective_lr(_get(config, "model.source") or "demo", _get(config, "optim.lr"))
    schedule = _get(config, "optim.schedule")
    out["optim.schedule_steps"] = None if schedule == "constant" else _get(config, "steps")
    return out


def run_identity(
    config: TrainConfig, spec: ArchSpec, model_dir: Path, files: Mapping[str, Path] | None = None
) -> dict[str, Any]:
    """The identity of a run of ``config`` on model ``spec`` from ``model_dir``, fingerprints included.

    ``files`` are the weights the run loads (``models.loading.weight_files``), when the caller has them
    already; by default they are looked up here. The data file's hash is the one the data reader took
    if it has read the file (``fingerprint.remember_sha256``), else the file is read for it."""
    from slidekit.data import data_fingerprint
    from slidekit.data.configured import tokenizer_dir
    from slidekit.fingerprint import files_fingerprint, weights_fingerprint
    from slidekit.models.loading import DEMO_MODEL, weight_files

    mc = config.model
    demo = mc.source == DEMO_MODEL
    if files is None:
        files = {} if mc.random_init or demo else weight_files(model_dir)
    return identity(
        config.to_dict(),
        model=architecture(spec),
        fingerprints={
            "model.weights": weights_fingerprint(files, init_seed=mc.init_seed),
            "model.tokenizer": files_fingerprint(tokenizer_dir(config, model_dir)),
            "data.file": data_fingerprint(config.data.path, config.data.split),
        },
    )


def completed(saved: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded identity ``saved`` with each ``ADDED`` field it lacks (or records as None)
    filled in from the configuration it recorded (``config``, ``TrainConfig.to_dict()``), else its default."""
    out = dict(saved)
    for dotted, default in ADDED.items():
        if out.get(dotted) is None:
            value = _get(config, dotted)
            out[dotted] = copy.deepcopy(default) if value is None else value
    return out


def _show(value: Any) -> str:
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:19]  # "sha256:" and 12 hex digits
    return repr(value)


def differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, worlds: tuple[int, int] = (1, 1)
) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's identity with the resuming run's: (changes, ``FIXED`` fields unchecked).

    A change reads ``"data.seq_len: 128 -> 256"``; a field the checkpoint did not record (an older
    slidekit) is unchecked, not a change. ``worlds``: the data-parallel world sizes that wrote the
    checkpoint and that resume it; ``grad_accum`` is compared as the step's batch, ranks x grad_accum
    (``step_batch_change``)."""
    changes, unchecked = [], []
    for key in FIXED:
        if key not in saved:
            unchecked.append(key)
        elif key == "grad_accum" and key in current:
            change = step_batch_change(saved[key], current[key], worlds)
            if change:
                changes.append(change)
        elif key in current and saved[key] != current[key]:
            changes.append(f"{key}: {_show(saved[key])} -> {_show(current[key])}")
    return changes, unchecked


def step_batch_change(saved: Any, current: Any, worlds: tuple[int, int]) -> str | None:
    """What changes in the step's batch (ranks x ``grad_accum`` micro-batches) from the checkpoint's
    ``saved`` grad_accum on ``worlds[0]`` ranks to ``current`` on ``worlds[1]``, with the grad_accum that
    keeps it; None when it is the same."""
    before, now = worlds
    if before == now or not isinstance(saved, int) or not isinstance(current, int):
        return None if saved == current else f"grad_accum: {_show(saved)} -> {_show(current)}"
    if saved * before == current * now:
        return None
    total = saved * before
    keep = (
        f"grad_accum {total // now} on {_on(now)} keeps it"
        if total % now == 0
        else f"no grad_accum keeps it on {_on(now)}: resume on a world size dividing {total}"
    )
    return (
        f"grad_accum: {saved} on {_on(before)} -> {current} on {_on(now)} (the step's batch, ranks x "
        f"grad_accum, {total} -> {current * now} micro-batches; {keep})"
    )


def _on(world: int) -> str:
    return "one process" if world == 1 else f"{world} ranks"


def changed_settings(saved_config: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """The ``NOTED`` settings that differ between a checkpoint's configuration and the resuming one's."""
    out = []
    for dotted in NOTED:
        before, now = _get(saved_config, dotted), _get(config, dotted)
        if before != now:
            out.append(f"{dotted} {before!r} -> {now!r}")
    return out
