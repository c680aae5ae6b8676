"""Resuming a run: which checkpoint, what to do with damaged ones, and what the run may not change.

``restore(engine, checkpoints, target, identity)`` puts a checkpoint into the engine and returns
its path and metadata. ``target`` is what ``run.resume`` (CLI ``--resume [STEP|PATH]``) asks for:

``"latest"``
    the newest checkpoint that restores cleanly. A damaged one, whether the damage shows at once
    (missing or truncated files, edited metadata) or only when its bytes are read and fail their
    checksums (a flipped bit), is moved aside to ``damaged-step-*`` (``checkpoint.quarantine``)
    with a warning, and the next older one is tried. The run then writes that step again, and no
    later resume trips over it.
a step number, or a checkpoint directory's path
    exactly that checkpoint; damage is an error that lists the steps there are. Checkpoints of this
    run newer than the one resumed from belong to the abandoned continuation: they are moved aside
    to ``superseded-step-*`` with a warning (not deleted), so the run can write those steps again
    and a later ``--resume`` does not jump back to them.

Before any tensor is read, the checkpoint's identity is compared with the run's
(``slidekit.identity``): a change to the weights, data, batch shape, seeds or learning-rate schedule
is refused with every changed field named; a checkpoint of a slidekit that recorded no
fingerprints is resumed with a warning naming what it could not check. The optimizer comes first,
with its own message: the checkpoint's recorded optimizer against the configured one, then its state
arrays against the ones the configured optimizer keeps (another optimizer, or another version of it,
is named as such, never as "missing arrays"). A checkpoint of another data-parallel world size is
re-sharded by the restore (``slidekit.distributed.reshard``); the identity then compares the step's
batch, ranks x ``grad_accum``, instead of ``grad_accum`` alone.

Test: ``pytest tests/test_resume.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit import checkpoint as ck
from slidekit import identity as ident
from slidekit.engine import snapshot
from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from slidekit.engine import Engine

__all__ = ["check_identity", "check_optimizer", "check_state_arrays", "restore", "saved_identity"]


def _steps(checkpoints: Path) -> str:
    steps = [s for s, _ in ck.step_dirs(checkpoints)]
    return f"{checkpoints} holds steps {steps}" if steps else f"{checkpoints} holds no checkpoint"


def saved_identity(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The identity a checkpoint recorded, or for an older one what its configuration says of it."""
    if "identity" in meta:  # one that predates a field (identity.ADDED) has what its configuration says
        return ident.completed(meta["identity"], meta.get("config", {}))
    model = {f"model.{k}": v for k, v in dict(meta.get("model", {})).items()}
    return ident.identity(meta.get("config", {}), model=model, fingerprints={})


def check_identity(
    path: Path, meta: Mapping[str, Any], current: Mapping[str, Any], *, worlds: tuple[int, int] = (1, 1)
) -> None:
    """Refuse checkpoint ``path`` when the run's identity differs from the one it recorded. ``worlds``:
    the data-parallel world sizes that wrote it and that resume it (the step's batch is ranks x
    grad_accum, so on another world size grad_accum must change to keep it)."""
    changes, unchecked = ident.differences(saved_identity(meta), current, worlds=worlds)
    if changes:
        raise ck.CheckpointMismatch(
            f"cannot resume from {path}: this run differs from the one that wrote it in what a resume "
            f"must keep: {'; '.join(changes)}. Resume with the settings that wrote it, or start a fresh "
            "run directory (a resume may change tiers, placement, device, logging and checkpointing; "
            "see slidekit.identity for the full list)"
        )
    if unchecked:
        warnings.warn(
            f"checkpoint {path} was written by a slidekit that did not record {', '.join(unchecked)}: "
            "resuming without checking them",
            RuntimeWarning,
            stacklevel=3,
        )


def _recorded_optimizer(meta: Mapping[str, Any]) -> str | None:
    """The optimizer that wrote a checkpoint, from its identity or (older ones) its configuration."""
    name = dict(meta.get("identity", {})).get("optim.name")
    if name is None:
        name = dict(dict(meta.get("config", {})).get("optim", {})).get("name")
    return name if isinstance(name, str) else None


def _keep_optimizer(name: str) -> str:
    return (
        f"resume with the optimizer that wrote it (optim.name={name!r}, CLI: --optimizer {name}); to go on "
        "with another optimizer, start a new run (a new run directory) from an export of this one's weights"
    )


def check_optimizer(path: Path, meta: Mapping[str, Any], configured: str | None) -> None:
    """Refuse checkpoint ``path`` when the optimizer it records is not the ``configured`` one."""
    recorded = _recorded_optimizer(meta)
    if recorded is not None and configured is not None and recorded != configured:
        raise ck.CheckpointMismatch(
            f"cannot resume from {path}: it holds the state of optimizer {recorded!r}, and this run is "
            f"configured with {configured!r} (optim.name); an optimizer continues only from its own state: "
            + _keep_optimizer(recorded)
        )


def _state_names(names: Any) -> str:
    """The state buffers of unit 0 among checkpoint array ``names``, e.g. "exp_avg, exp_avg_sq"."""
    return ", ".join(sorted(n.split("/", 2)[2] for n in names if n.startswith("state/0/"))) or "none"


def check_state_arrays(engine: Engine, path: Path, meta: Mapping[str, Any], configured: str | None) -> None:
    """Refuse, naming the optimizer, a checkpoint whose masters fit the engine but whose optimizer state
    is not what the configured optimizer keeps (``snapshot.restore`` would list "missing arrays")."""
    saved = snapshot.saved_world(path)  # another world size: the arrays of rank 0's part of the old cut
    same = saved == snapshot.engine_world(engine)
    expected = snapshot.expected_arrays(engine) if same else snapshot.expected_arrays(engine, saved, 0)
    arrays = ck.read_manifest(path).arrays
    have = {n: (a.dtype, tuple(a.shape)) for n, a in arrays.items()}
    masters = {n for n in expected if n.startswith("master/")} | {n for n in have if n.startswith("master/")}
    if any(have.get(n) != expected.get(n) for n in masters):
        return  # another model: verify_compatible names the differences
    state = {n: v for n, v in expected.items() if n.startswith("state/")}
    if {n: v for n, v in have.items() if n.startswith("state/")} == state:
        return
    name = repr(configured) if configured else "the configured optimizer"
    recorded = _recorded_optimizer(meta)
    if recorded and recorded != configured:
        who, fix = f"optimizer {recorded!r}", _keep_optimizer(recorded)
    else:
        who = f"another version or setting of {name}"
        fix = (
            "resume with the slidekit and optimizer plugin (and their settings) that wrote it; to go on with "
            "this one, start a new run (a new run directory) from an export of this one's weights"
        )
    raise ck.CheckpointMismatch(
        f"cannot resume from {path}: its optimizer state (per unit: {_state_names(have)}) is not the state "
        f"{name} keeps (per unit: {_state_names(state)}, with these dtypes and sizes): the checkpoint was "
        f"written by {who}. {fix[0].upper() + fix[1:]}"
    )


def _try(engine: Engine, path: Path, current: Mapping[str, Any]) -> dict[str, Any]:
    meta = ck.load_meta(path)
    configured = current.get("optim.name")
    check_optimizer(path, meta, configured)
    check_identity(path, meta, current, worlds=(snapshot.saved_world(path), snapshot.engine_world(engine)))
    check_state_arrays(engine, path, meta, configured)
    snapshot.restore(engine, path)  # every array read back and checksummed (re-sharded: its ranges)
    return meta


def _latest(engine: Engine, checkpoints: Path, current: Mapping[str, Any]) -> tuple[Path, dict[str, Any]]:
    ck.remove_leftovers(checkpoints)
    aside = []
    for _step, path in reversed(ck.step_dirs(checkpoints)):
        damage = "; ".join(ck.problems(path)[:5])
        if not damage:
            try:
                return path, _try(engine, path, current)
            except ck.CheckpointCorrupt as exc:  # found only by reading: a checksum failed
                damage = str(exc)
        moved = ck.quarantine(path, damage)
        aside.append(moved)
        warnings.warn(
            f"skipping damaged checkpoint {path}: {damage}; moved it aside to {moved} (delete it once "
            "inspected) and trying the next older one",
            RuntimeWarning,
            stacklevel=3,
        )
    if aside:
        raise ck.CheckpointCorrupt(
            f"nothing to resume: every checkpoint in {checkpoints} is damaged (moved aside: "
            f"{', '.join(p.name for p in aside)}); start without resume"
        )
    raise ConfigError(
        f"nothing to resume: {checkpoints} holds no complete checkpoint; "
        "start without resume, or point run.dir at the run you want to continue"
    )


def _exact(
    engine: Engine, checkpoints: Path, target: int | str, current: Mapping[str, Any]
) -> tuple[Path, dict[str, Any]]:
    path = ck.step_dir(checkpoints, target) if isinstance(target, int) else Path(target).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"run.resume={target!r}: there is no checkpoint directory {path}; {_steps(checkpoints)}. "
            "Give one of those steps, a checkpoint directory, or resume alone (--resume) for the newest "
            "intact checkpoint"
        )
    fix = f"{_steps(checkpoints)}: resume from another (--resume STEP), or --resume alone for the newest"
    damage = ck.problems(path)
    if damage:
        raise ck.CheckpointCorrupt(f"checkpoint {path} is damaged: {'; '.join(damage[:5])}. {fix}")
    try:
        meta = _try(engine, path, current)
    except ck.CheckpointCorrupt as exc:
        raise ck.CheckpointCorrupt(f"{exc}. {fix}") from exc
    newer = [p for s, p in ck.step_dirs(checkpoints) if s > int(meta["step"]) and p != path]
    moved = [ck.set_aside(p, "superseded", f"the run resumed from {path} instead") for p in newer]
    if moved:
        warnings.warn(
            f"resumed from step {meta['step']}, so this run's newer checkpoints belong to the continuation "
            f"it abandons: moved them aside ({', '.join(str(p) for p in moved)}); delete them when no "
            "longer needed",
            RuntimeWarning,
            stacklevel=3,
        )
    return path, meta


def restore(
    engine: Engine, checkpoints: Path, target: int | str, current: Mapping[str, Any]
) -> tuple[Path, dict[str, Any]]:
    """Restore the checkpoint ``target`` asks for (see the module docstring) into ``engine``, after
    checking it against the run's identity ``current``; return its path and metadata."""
    if target == "latest":
        return _latest(engine, checkpoints, current)
    return _exact(engine, checkpoints, target, current)
