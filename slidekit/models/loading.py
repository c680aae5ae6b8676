"""Load a model: its Hugging Face config, and its weights into flat FP32 unit vectors.

Sources: ``"demo"`` (the tiny Llama-style model embedded in the package), a
local Hugging Face model directory (``config.json`` plus ``model.safetensors``
or a sharded ``model.safetensors.index.json``), or a directory with only a
config, which starts from random weights when asked to.

Weights stream tensor by tensor from safetensors into the unit masters, so a
model never needs to fit in memory twice. Random initialisation follows
transformers' (normal(0, initializer_range) for matrices, ones for norms, zeros
for biases and for the embedding row of ``pad_token_id``) with one generator
per unit, so it does not depend on order or threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from slidekit.errors import ModelLoadError
from slidekit.models.base import ArchSpec, UnitLayout
from slidekit.models.overrides import apply as apply_overrides

__all__ = [
    "DEMO_MODEL",
    "LOAD_STAGING_UNITS",
    "LOAD_THREADS",
    "StagingBytes",
    "demo_dir",
    "fill_masters",
    "init_unit",
    "load_hf_config",
    "load_staging_bytes",
    "load_unit_weights",
    "weight_files",
]

DEMO_MODEL = "demo"


def demo_dir() -> Path:
    """The embedded demo assets: model config, tokenizer, sample data."""
    return Path(str(resources.files("slidekit") / "resources" / "demo"))


def load_hf_config(source: str, overrides: Mapping[str, Any] | None = None) -> tuple[Any, Path]:
    """The transformers config of ``source`` (with ``overrides`` applied) and the model directory."""
    from transformers import AutoConfig

    directory = demo_dir() / "model" if source == DEMO_MODEL else Path(source).expanduser()
    if not directory.exists():
        raise ModelLoadError(
            f"model directory {str(directory)!r} does not exist; pass a local Hugging Face "
            f"model directory (config.json + *.safetensors) or {DEMO_MODEL!r}"
        )
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{str(directory)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    if overrides:
        config = apply_overrides(config, overrides)
    return config, directory


def weight_files(directory: Path) -> dict[str, Path]:
    """Parameter name -> safetensors file holding it; empty when the directory has no weights.

    A damaged index, a shard it names that is missing, or a damaged single file is a
    ``ModelLoadError`` naming the file.
    """
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(name): directory / str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"the shard index {str(index)!r} is damaged ({type(exc).__name__}: {exc}): it must be JSON "
                'with a "weight_map" of parameter name -> shard file; re-download the model'
            ) from exc
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise ModelLoadError(
                f"{index.name} in {str(directory)!r} names shard(s) that are missing: {missing}; "
                "re-download the model (every file the index names)"
            )
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        with _open_weights(single) as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a Mapping)
    return {}


def _open_weights(path: Path) -> Any:
    """``safe_open`` of one safetensors file; a missing or damaged one is a ModelLoadError naming it."""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelLoadError(f"the weights file {str(path)!r} is missing; re-download the model")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise _damaged(path, exc) from exc


def _damaged(path: Path, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"the weights file {str(path)!r} is damaged: {exc} (truncated, empty or not a safetensors file); "
        "re-download it"
    )


def load_unit_weights(unit: UnitLayout, files: Mapping[str, Path], master: torch.Tensor) -> None:
    """Copy one unit's tensors from safetensors into its flat FP32 ``master`` (upcasting)."""
    missing = [e.name for e in unit.entries if e.name not in files]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}; "
            "does the config match the weights?"
        )
    master.zero_()
    by_file: dict[Path, list[Any]] = {}
    for e in unit.entries:
        by_file.setdefault(files[e.name], []).append(e)
    for path, entries in by_file.items():
        with _open_weights(path) as f:
            for e in entries:
                try:
                    t = f.get_tensor(e.name)
                except Exception as exc:
                    raise _damaged(path, exc) from exc
                if tuple(t.shape) != e.shape:
                    raise ModelLoadError(
                        f"{e.name} has shape {tuple(t.shape)} in {path.name}, the config implies {e.shape}"
                    )
                master[e.offset : e.stop].view(e.shape).copy_(t)


def init_unit(spec: ArchSpec, unit: UnitLayout, master: torch.Tensor, seed: int) -> None:
    """Random initialisation of one unit into its flat FP32 ``master``, reproducible per (seed, unit)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + unit.index)
    master.zero_()
    for e in unit.entries:
        view = master[e.offset : e.stop].view(e.shape)
        if e.key.endswith("norm.weight"):
            view.fill_(1.0)
        elif e.key.endswith(".weight"):
            view.normal_(0.0, spec.initializer_range, generator=gen)
            if e.key == "embed_tokens.weight" and spec.pad_token_id is not None:
                view[spec.pad_token_id].zero_()  # as transformers initialises nn.Embedding(padding_idx=...)
        # biases stay zero


#: ``fill_masters`` fills a unit whose master lives on a device through an FP32 host copy of its own
#: size. The copies staged at once hold at most the bytes of this many of the largest such units: the
#: host memory setup needs beyond the plan's steady state (the planner counts it: ``load_staging_bytes``).
#: Smaller units share that allowance, so more of them fill side by side. Units on the host fill their
#: masters in place, all threads at a time.
LOAD_STAGING_UNITS = 2
#: Threads that fill masters (random initialisation or safetensors reads), at most.
LOAD_THREADS = 8


def load_staging_bytes(device_units: Sequence[int], sharded_units: Sequence[int] = ()) -> int:
    """Host bytes setup stages while filling masters: ``LOAD_STAGING_UNITS`` of the largest units whose
    master is on a device (``device_units``, their parameter counts), FP32; with data-parallel shards
    (``sharded_units``: every unit's whole parameter count), one whole unit at a time (``fill_shards``)."""
    if sharded_units:
        return 4 * max(sharded_units)
    largest = sorted(device_units, reverse=True)[:LOAD_STAGING_UNITS]
    return 4 * sum(largest)


class StagingBytes:
    """At most ``limit`` bytes of host copies staged at once: ``hold(n)`` waits until ``n`` more fit. A
    request above the limit could never be served, so it is refused (``fill_masters`` sizes the limit
    to its largest unit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        if n > self.limit:
            raise ValueError(f"staging {n} bytes at once exceeds the allowance of {self.limit}")
        with self._changed:
            self._changed.wait_for(lambda: self._held + n <= self.limit)
            self._held += n
        try:
            yield
        finally:
            with self._changed:
                self._held -= n
                self._changed.notify_all()


def fill_masters(spec: ArchSpec, masters: Sequence[torch.Tensor], files: Mapping[str, Any], seed: int) -> None:
    """Each unit's FP32 master from the weight ``files`` (``weight_files``), or initialised at random from
    ``seed`` when there are none; masters on a device are filled through a host copy, the copies at once
    holding at most ``load_staging_bytes`` of the device units (the planner's count). One generator per
    unit makes the result independent of the order, so units load in parallel."""
    on_device = [m.numel() for m in masters if m.device.type != "cpu"]
    staging = StagingBytes(load_staging_bytes(on_device))

    def fill(unit: UnitLayout, master: torch.Tensor) -> None:
        if files:
            load_unit_weights(unit, files, master)
        else:
            init_unit(spec, unit, master, seed)

    def load(unit: UnitLayout, master: torch.Tensor) -> None:
        if master.device.type == "cpu":
            fill(unit, master)
            return
        with staging.hold(4 * master.numel()):  # a unit resident on the device: through a host copy
            host = torch.empty_like(master, device="cpu")
            fill(unit, host)
            master.copy_(host)
            del host

    with ThreadPoolExecutor(min(LOAD_THREADS, os.cpu_count() or 1), thread_name_prefix="slidekit-load") as pool:
        list(pool.map(load, spec.units, masters))
