"""Speculative clipping's backup, taken by the bundled optimizers' ``step`` (``backup_out``).

An optimizer that declares ``fused_backup = True`` (``slidekit.interfaces.FusedBackupOptimizer``)
takes ``step(..., backup_out=...)``: "master" and one buffer per state name, each of its source's
dtype and size, into which it writes the values master and state hold *before* the update.
``layer_adam`` and ``adamw_8bit`` do it in the update's own pass in their C++ kernels
(``csrc/backup_copy.h``); their other paths (pure torch, tensors on a GPU) copy first and then
update (``copy_backup``). Either way the backup is the old bytes, and the update is the same bits as
without a backup.

``check_backup_out`` validates the buffers before anything is written: the names, dtypes, sizes,
contiguity and device, and that no backup overlaps an input (a wrong buffer would otherwise corrupt
the state it backs up). Its errors name the optimizer, the buffer and the fix.

Test: ``pytest tests/plugins/test_fused_backup.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["check_backup_out", "copy_backup", "overlapping"]


def overlapping(
    tensors: Mapping[str, Tensor | None], among: set[str] | None = None
) -> tuple[str, str] | None:
    """Two names of ``tensors`` whose bytes overlap, one of them in ``among`` (None: any), or None.
    None and empty tensors overlap nothing."""
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
        for k, t in tensors.items()
        if t is not None and t.numel()
    ]
    for i, (a0, a1, a) in enumerate(spans):
        for b0, b1, b in spans[i + 1 :]:
            if a0 < b1 and b0 < a1 and (among is None or a in among or b in among):
                return a, b
    return None


def check_backup_out(
    owner: str,
    backup_out: Mapping[str, Tensor],
    master: Tensor,
    state: Mapping[str, Tensor],
    others: Mapping[str, Tensor | None],
) -> dict[str, Tensor]:
    """``backup_out`` checked against the update's ``master`` and ``state`` (``others``: its other
    inputs, e.g. the gradient and ``lowp_out``, which no backup may overlap either); returns it as a
    dict. Raises ValueError (names, sizes, layout, device) or TypeError (dtypes) naming the buffer."""
    sources = {"master": master, **state}
    got, want = set(backup_out), set(sources)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise ValueError(
            f"{owner}: backup_out must name 'master' and each state buffer, {sorted(want)}; "
            + (f"it lacks {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"it has unknown {extra}" if extra else "")
            + ". Pass one buffer per name, as large as the one it backs up (HostStore.backup's, sliced "
            "like the state)"
        )
    out: dict[str, Tensor] = {}
    for name, src in sources.items():
        t = backup_out[name]
        what = f"{owner}: backup_out[{name!r}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
        if t.dtype != src.dtype:
            raise TypeError(
                f"{what} must be {src.dtype} like the {name} it backs up, got {t.dtype}; allocate it "
                "with the dtype state_layout gives"
            )
        if t.numel() != src.numel() or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{what} must be a contiguous flat vector of {src.numel()} elements like the {name} it "
                f"backs up, got shape {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}; "
                "slice the backup exactly as the state is sliced"
            )
        if t.device != master.device:
            raise ValueError(f"{what} must be on the master's device {master.device}, got {t.device}")
        out[name] = t
    backups = {f"backup_out[{k!r}]": t for k, t in out.items()}
    clash = overlapping({**backups, **sources, **others}, among=set(backups))
    if clash is not None:
        raise ValueError(
            f"{owner}: {clash[0]} and {clash[1]} overlap in memory; the backup needs buffers of its own"
        )
    return out


def copy_backup(backup_out: Mapping[str, Tensor], master: Tensor, state: Mapping[str, Tensor]) -> None:
    """The copy path: master and state copied into ``backup_out`` (checked), before the update runs."""
    backup_out["master"].copy_(master)
    for name, t in state.items():
        backup_out[name].copy_(t.reshape(-1))
