"""Export a fine-tuned model as a Hugging Face model directory, replacing nothing slidekit did not write.

    OUT/
      config.json                         the model's config ("dtype" set to the export dtype)
      model.safetensors                   or model-0000i-of-0000n.safetensors + model.safetensors.index.json
      generation_config.json              the source model's, copied, when it has one
      tokenizer.json, tokenizer_config.json, ...   when the source model had a tokenizer
      README.md                           the model card (``slidekit.modelcard``), when one is given
      slidekit-export.json                the manifest: every file this export wrote, dtype, step, source

``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it. Tensors
are converted and written one shard at a time (at most ``shard_bytes`` each)
from the FP32 masters, so an export needs about one shard of extra memory.

What may be replaced (``check_target``, docs/runs.md): OUT is new, an empty
directory, or a previous slidekit export (recognised by its manifest), which
is replaced only with ``overwrite`` and then only the files its manifest
lists: a file the user added stays. A non-empty directory without a manifest
is refused, with or without ``overwrite``; so is OUT when it is a file, lies
below a file, or is or contains a guarded path (the current directory, the run
directory, the source model, the data, ...: ``export_guards``). A README.md or
generation_config.json in OUT that slidekit did not write (a card the user
wrote into a previous export) is kept, with a warning, and the export goes
without its own.

The config is written with ``dtype``, the name transformers 5 reads and
writes; transformers deprecates ``torch_dtype`` and says so when it is set.

How it is written: into ``model/`` of a sibling ``.OUT.slidekit-export-<pid>-*``
directory (``slidekit.owned``: its ``.owner`` is locked while the export
lives), every file fsynced, then put in place in one rename where possible:
a rename for a new or empty OUT, an atomic exchange (Linux ``renameat2``) for
a previous export holding only its own files.
Otherwise (OUT holds a user's file, or is a mount point) files are moved one
by one under a manifest that lists the old and the new files, so OUT is a
recognisable export at every moment. ``remove_leftovers`` deletes the staging
directories of exports that died (no process holds their lock); every export
calls it first.

Test: ``pytest tests/test_export.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch

from slidekit import owned
from slidekit.atomic import fsync_path, fsync_tree, write_text_atomically
from slidekit.config import EXPORT_DTYPES
from slidekit.errors import ConfigError, SlidekitError
from slidekit.modelcard import extra_files
from slidekit.paths import describe, directory_path, encloses

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = [
    "MANIFEST",
    "ExportError",
    "Guard",
    "Target",
    "check_dtype",
    "check_target",
    "export_guards",
    "export_model",
    "remove_leftovers",
]

MANIFEST = "slidekit-export.json"
_FORMAT = "slidekit-export"
# Staging: an owned directory ".OUT.slidekit-export-<pid>-*" beside OUT (or ".slidekit-export-<pid>-*"
# inside OUT when it is a mount point), holding the export being assembled in its subdirectory _STAGED.
_STAGING = ".slidekit-export-"
_STAGED = "model"
_DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPES}


class ExportError(SlidekitError):
    """An export failed while writing; the message says where the trained weights are."""


@dataclass(frozen=True, slots=True)
class Guard:
    """A path an export target may not be or contain (with ``inside``: nor lie inside)."""

    what: str  # "the run directory", for the error message
    path: Path
    inside: bool = False


@dataclass(frozen=True, slots=True)
class Target:
    """A checked export (``check_target``): where, the manifest of the previous export there (None:
    none), and the dtype to write."""

    path: Path
    previous: dict[str, Any] | None
    dtype: str = "bfloat16"


def export_guards(config: TrainConfig, model_dir: Path | None) -> list[Guard]:
    """The paths a run's export may not replace: the current directory, the run directory (and its own
    entries, which it may not go inside either), the source model, the data, the offload directory, the trace."""
    from slidekit.data import data_file
    from slidekit.run import RUN_ENTRIES

    rc = config.run
    guards = [Guard("the current directory", Path.cwd())]
    if rc.dir:
        run = Path(rc.dir).expanduser()
        guards.append(Guard("the run directory", run))
        guards += [Guard(f"the run directory's {name}", run / name, inside=True) for name in RUN_ENTRIES]
    if model_dir is not None:
        guards.append(Guard("the source model", model_dir))
    guards.append(Guard("the data file", data_file(config.data.path)))
    if config.engine.offload_dir:
        guards.append(Guard("the offload directory", Path(config.engine.offload_dir).expanduser()))
    if rc.trace:
        guards.append(Guard("the trace file", Path(rc.trace).expanduser()))
    return guards


def check_dtype(dtype: str) -> None:
    """ConfigError unless ``dtype`` is one an export can write (``EXPORT_DTYPES``)."""
    if dtype not in _DTYPES:
        raise ConfigError(f"export dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def check_target(
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    guards: Sequence[Guard] = (),
    dtype: str = "bfloat16",
) -> Target:
    """``out`` as an export target for weights in ``dtype`` (``check_dtype``), or ConfigError naming what
    it would destroy (or the bad dtype) and what to do instead."""
    check_dtype(dtype)
    path = Path(os.path.realpath(Path(out).expanduser()))
    for g in guards:
        guarded = Path(os.path.realpath(g.path))
        if encloses(path, guarded):
            relation = "is" if path == guarded else "contains"
            raise ConfigError(
                f"the export target {str(path)!r} {relation} {g.what} ({guarded}), which the export would "
                "replace; export into a new or an empty directory (run.export_dir, CLI: --export)"
            )
        if g.inside and encloses(guarded, path):
            raise ConfigError(
                f"the export target {str(path)!r} lies inside {g.what} ({guarded}), which slidekit manages; "
                "export into a new or an empty directory (run.export_dir, CLI: --export)"
            )
    directory_path(path, role="export target", option="run.export_dir, CLI: --export")
    if not path.is_dir():
        return Target(path, None, dtype)
    entries = [e for e in os.listdir(path) if not e.startswith(_STAGING)]
    if not entries:
        return Target(path, None, dtype)
    previous, problem = _read_manifest(path)
    if problem:
        raise ConfigError(
            f"the export target {str(path)!r} holds {MANIFEST}, but {problem}, so it is not a slidekit export "
            "slidekit can replace; export into a new or an empty directory"
        )
    if previous is None:
        raise ConfigError(
            f"the export target {str(path)!r} is not empty ({describe(entries)}) and holds no slidekit export; "
            "slidekit never deletes files it did not write: export into a new or an empty directory"
        )
    if not overwrite:
        step = f" of step {previous['step']}" if "step" in previous else ""
        raise ConfigError(
            f"the export target {str(path)!r} holds a previous slidekit export{step}; set overwrite=True "
            "(run.overwrite, CLI: --overwrite) to replace it (only the files its manifest lists), or export "
            "into a new directory"
        )
    return Target(path, previous, dtype)


def _read_manifest(directory: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) for a slidekit export, (None, None) without a manifest, (None, why) for a bad one."""
    path = directory / MANIFEST
    if not path.exists():
        return None, None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"it cannot be read ({exc})"
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != 1:
        return None, f"it is not a {_FORMAT} manifest of version 1"
    files = doc.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None, "its 'files' is not a list of file names"
    bad = [f for f in files if not _plain_relative(f)]
    if bad:
        return None, f"it lists paths outside the directory ({describe(bad)})"
    return doc, None


def _plain_relative(name: str) -> bool:
    p = PurePosixPath(name)
    return (
        bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and name != MANIFEST
    )


# ---------------------------------------------------------------------- writing


def _shard_names(state: Mapping[str, torch.Tensor], dtype: torch.dtype, limit: int) -> Iterator[list[str]]:
    """Tensor names grouped into shards of at most ``limit`` bytes (a larger tensor gets a shard alone)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shard: list[str] = []
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * itemsize
        if shard and size + nbytes > limit:
            yield shard
            shard, size = [], 0
        shard.append(name)
        size += nbytes
    if shard:
        yield shard


def export_model(
    out: str | os.PathLike[str] | Target,
    *,
    hf_config: Any,
    state: Mapping[str, torch.Tensor],
    tokenizer: Any | None,
    dtype: str | None = None,
    shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    guards: Sequence[Guard] = (),
    info: Mapping[str, Any] | None = None,
    source_dir: str | os.PathLike[str] | None = None,
    model_card: str | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> Path:
    """Write ``state`` (Hugging Face names -> FP32 tensors) with ``hf_config`` and ``tokenizer`` to ``out``.

    ``out`` is a path, checked here with ``check_target`` (``overwrite``, ``guards``, ``dtype``: default
    bfloat16), after which the staging directories dead exports left there are removed
    (``remove_leftovers``); or the ``Target`` that ``check_target`` returned, when the caller has made
    both steps already (the trainer, to refuse a target before it saves a checkpoint): nothing is
    checked or removed again, and ``dtype`` may only repeat the target's. ``info`` goes into the
    manifest (the trainer records the step, the configured steps and the source model).
    ``source_dir``: the model directory trained from, whose ``generation_config.json`` (if any) is
    copied; ``model_card``: the text of ``README.md`` (``slidekit.modelcard``; None: no card). Returns the
    directory. ``progress(stage, detail)`` is called with ``("written", staging_dir)`` when every file
    is written and synced, ``("install", target)`` just before it is put in place and, when files are
    moved one by one, ``("moved", name)`` after each; an exception it raises fails the export exactly
    as an I/O error would (tests inject crashes this way).
    """
    stage = progress or (lambda _stage, _detail: None)
    if isinstance(out, Target):
        if dtype is not None and dtype != out.dtype:
            raise ValueError(
                f"export_model got dtype={dtype!r} for a target checked for {out.dtype!r}; "
                "pass the dtype to check_target"
            )
        target = out
    else:
        target = check_target(out, overwrite=overwrite, guards=guards, dtype=dtype or "bfloat16")
        remove_leftovers(target.path)
    target.path.parent.mkdir(parents=True, exist_ok=True)
    extras = extra_files(
        target.path,
        set(target.previous["files"]) if target.previous else set(),
        None if source_dir is None else Path(source_dir),
        model_card,
    )
    staging, owner = _staging_dir(target.path)
    exchanged = False
    try:
        files = _write_model(staging, hf_config, state, tokenizer, target.dtype, shard_bytes, extras)
        manifest = {"format": _FORMAT, "version": 1, "dtype": target.dtype, **(info or {}), "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        fsync_tree(staging)
        stage("written", str(staging))
        stage("install", str(target.path))
        exchanged = _install(staging, target, manifest, stage)
    finally:
        # Exchanged: the staging directory holds the previous export; remove what it listed (files it
        # did not list stay, in an owned directory the next start removes). Otherwise it is gone after
        # a rename, or holds what this export wrote.
        left = False
        if exchanged:
            assert target.previous is not None
            left = not _remove_old_export(staging, target.previous["files"])
        if not left:
            shutil.rmtree(owner.path, ignore_errors=True)
        owner.release()  # after the files are gone: a locked directory is never mistaken for a leftover
    return target.path


def _write_model(
    root: Path,
    hf_config: Any,
    state: Mapping[str, torch.Tensor],
    tokenizer: Any,
    dtype_name: str,
    limit: int,
    extras: Mapping[str, Path | str],
) -> list[str]:
    """Write the model files and ``extras`` (``slidekit.modelcard.extra_files``) into ``root``; their paths
    relative to it."""
    from safetensors.torch import save_file

    dtype = _DTYPES[dtype_name]
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {n: t for n, t in state.items() if not (tied and n == "lm_head.weight")}
    shards = list(_shard_names(tensors, dtype, limit))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards, strict=True):
        converted = {n: tensors[n].to(dtype).contiguous() for n in shard}  # one shard in memory at a time
        save_file(converted, str(root / fname), metadata={"format": "pt"})
        for n, t in converted.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
        del converted
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.dtype = dtype_name  # transformers 5's name ("torch_dtype" is deprecated, and warns)
    hf_config.save_pretrained(root)
    if tokenizer is not None:
        tokenizer.save_pretrained(root)
    for name, content in extras.items():  # after the tokenizer: ours, not whatever it may save
        if isinstance(content, Path):
            shutil.copyfile(content, root / name)
        else:
            (root / name).write_text(content, encoding="utf-8")
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _staging_dir(target: Path) -> tuple[Path, owned.OwnedDir]:
    """A new staging directory ``<owned dir>/model`` and the owned directory around it (``slidekit.owned``:
    its ``.owner`` is locked while the export lives; remove the owned directory, then release it).

    Beside ``target``, so the finished export is renamed into place and leaves the ``.owner`` behind;
    inside it when ``target`` is a mount point (a rename cannot cross file systems).
    """
    if target.is_dir() and os.stat(target).st_dev != os.stat(target.parent).st_dev:
        owner = owned.OwnedDir.create(target, _STAGING)
    else:
        owner = owned.OwnedDir.create(target.parent, f".{target.name}{_STAGING}")
    staging = Path(owner.path) / _STAGED
    try:
        staging.mkdir()
    except BaseException:
        shutil.rmtree(owner.path, ignore_errors=True)
        owner.release()
        raise
    return staging, owner


def remove_leftovers(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the staging directories that exports to ``target`` left when they died; return them.

    ``target`` as ``check_target`` reads it (``~`` expanded, symlinks resolved: staging directories lie
    beside the real target). Only slidekit's own staging directories, and only those no live export
    holds (``owned.reclaim``: their owner's lock is free).
    """
    target = Path(os.path.realpath(Path(target).expanduser()))
    places = [(target.parent, f".{target.name}{_STAGING}")]
    if target.is_dir():
        places.append((target, _STAGING))
    removed = []
    for parent, prefix in places:
        gone, _kept = owned.reclaim(parent, prefix)
        removed += [item.path for item in gone] + _remove_unowned(parent, prefix)
    return removed


def _remove_unowned(parent: Path, prefix: str) -> list[Path]:
    """Staging directories of exports from before owner records (a random name, the directory itself
    flock-ed while its export lived): removed when that lock is free."""
    removed = []
    for entry in parent.glob(f"{glob.escape(prefix)}*"):
        if owned.pid_of(entry.name, prefix) is not None or entry.is_symlink() or not entry.is_dir():
            continue
        if owned.lock_free(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# ---------------------------------------------------------------------- installing


def _install(
    staging: Path, target: Target, manifest: dict[str, Any], stage: Callable[[str, str], None]
) -> bool:
    """Put the finished export in ``staging`` at ``target`` (see the module docstring for the order).

    Returns True when the previous export was exchanged into ``staging``."""
    path, previous = target.path, target.previous
    beside = staging.parent.parent == path.parent  # the owned directory around it
    if beside and previous is None:
        try:
            os.replace(staging, path)  # atomic onto a new or an empty directory
            fsync_path(path.parent, directory=True)
            return False
        except OSError:
            pass  # the target was filled meanwhile: file by file, which refuses to replace others' files
    if beside and previous is not None and _holds_only(path, previous["files"]) and _exchange(staging, path):
        fsync_path(path.parent, directory=True)
        return True
    _install_files(staging, path, previous, manifest, stage)
    return False


def _holds_only(directory: Path, files: Sequence[str]) -> bool:
    """Whether ``directory`` holds just ``files`` and the manifest (and staging directories)."""
    own = {*files, MANIFEST}
    found = {
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if not p.is_dir() and not p.relative_to(directory).parts[0].startswith(_STAGING)
    }
    return found <= own


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _remove_old_export(directory: Path, files: Sequence[str]) -> bool:
    """Remove the files a previous export listed, then its (now empty) directories; anything else stays.
    Whether ``directory`` is gone."""
    for name in [*files, MANIFEST]:
        (directory / name).unlink(missing_ok=True)
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            sub.rmdir()
    try:
        directory.rmdir()
    except OSError:
        warnings.warn(
            f"{directory} holds files the replaced export did not list; they were left there",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def _install_files(
    staging: Path,
    path: Path,
    previous: dict[str, Any] | None,
    manifest: dict[str, Any],
    stage: Callable[[str, str], None],
) -> None:
    """Move the export into ``path`` file by file, replacing only files a previous export wrote.

    The manifest written first lists the old and the new files, so at every moment ``path`` is an export
    whose manifest covers everything slidekit put there; the final one lists the new files only.
    """
    old = set(previous["files"]) if previous else set()
    new = list(manifest["files"])
    theirs = [f for f in [*new, MANIFEST] if f not in old and (f != MANIFEST or not previous)]
    clash = [f for f in theirs if os.path.lexists(path / f)]
    if clash:
        raise ConfigError(
            f"the export target {str(path)!r} holds {describe(clash)}, which slidekit did not write and the "
            "export would replace; move them away, or export into a new or an empty directory"
        )
    path.mkdir(exist_ok=True)
    pending = {**manifest, "files": sorted(old | set(new)), "status": "replacing"}
    write_text_atomically(path / MANIFEST, json.dumps(pending, indent=1) + "\n")
    for name in new:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / name, path / name)  # the staging directory is on the target's file system
        stage("moved", name)
    for name in sorted(old - set(new)):
        (path / name).unlink(missing_ok=True)
    write_text_atomically(path / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    fsync_path(path, directory=True)
