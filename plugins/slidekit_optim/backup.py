"""Speculative clipping's second set of buffers, taken by the bundled optimizers' ``step``: ``backup_out``
or ``update_out``.

A speculating step (``slidekit.engine.speculation``) updates a unit before it knows whether the step
clips, so the values before the update must survive until it does. Two ways, each "master" and one
buffer per state name, each of its source's dtype and size:

* ``backup_out`` (``fused_backup = True``, ``slidekit.interfaces.FusedBackupOptimizer``): the step
  writes there the values master and state hold *before* the update, then updates them in place. A
  step that clips restores them from there.
* ``update_out`` (``fused_update_out = True``): the step writes there the values an update in place
  would leave in master and state, and leaves master and state as they were ("out of place"). A bet
  that wins swaps the two sets; one that loses finds the old values where they were.

``layer_adam`` and ``adamw_8bit`` do either in the update's own pass in their C++ kernels
(``csrc/backup_copy.h``): the backup costs its writes (layer_adam: 12 B/param more), the out-of-place
update no more bytes than the update in place, since it writes its outputs instead of its sources (on
the 2-core test machine, where the pass is bound by the cores, ~1.15x the time, the backup ~1.35x). Their
other paths (pure torch, tensors on a GPU) copy the sources into the buffers first (``copy_sources``),
then update in place: the sources for ``backup_out``, the buffers for ``update_out``. Either way the
backup is the old bytes and the update is the same bits as the plain update in place.

``check_buffers`` validates either set before anything is written: the names, dtypes, sizes,
contiguity and device, and that no buffer overlaps an input (a wrong buffer would otherwise corrupt the
state it backs up, or the update would read what it has already written); ``check_step_buffers`` also
refuses both sets at once. Their errors name the optimizer, the argument, the buffer and the fix.

Test: ``pytest tests/plugins/test_fused_backup.py tests/plugins/test_update_out.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Buffers", "check_buffers", "check_step_buffers", "copy_sources", "overlapping"]

#: The ``step`` argument a set of buffers came in: the values before the update, or the update itself.
Buffers = Literal["backup_out", "update_out"]

#: Per argument: how its buffer relates to its source, in messages ("... like the master <that>"), and
#: what overlapping buffers need.
_WORDING: dict[str, tuple[str, str]] = {
    "backup_out": ("it backs up", "the backup needs buffers of its own"),
    "update_out": ("whose update it receives", "the update's outputs need buffers of their own"),
}


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


def _check_names(owner: str, arg: Buffers, buffers: Mapping[str, Tensor], want: set[str]) -> None:
    got = set(buffers)
    if got == want:
        return
    missing, extra = sorted(want - got), sorted(got - want)
    raise ValueError(
        f"{owner}: {arg} must name 'master' and each state buffer, {sorted(want)}; "
        + (f"it lacks {missing}" if missing else "")
        + ("; " if missing and extra else "")
        + (f"it has unknown {extra}" if extra else "")
        + ". Pass one buffer per name, as large as its source (HostStore.backup's, sliced like the state)"
    )


def check_buffers(
    owner: str,
    arg: Buffers,
    buffers: Mapping[str, Tensor],
    master: Tensor,
    state: Mapping[str, Tensor],
    others: Mapping[str, Tensor | None],
) -> dict[str, Tensor]:
    """``buffers``, the ``step`` argument ``arg`` ("backup_out" or "update_out"), checked against the
    update's ``master`` and ``state`` (``others``: its other inputs, e.g. the gradient and ``lowp_out``,
    which no buffer may overlap either); returns it as a dict. Raises ValueError (names, sizes, layout,
    device, overlaps) or TypeError (dtypes) naming the buffer as ``arg[name]``."""
    sources = {"master": master, **state}
    _check_names(owner, arg, buffers, set(sources))
    relation, own_buffers = _WORDING[arg]
    out: dict[str, Tensor] = {}
    for name, src in sources.items():
        t = buffers[name]
        what = f"{owner}: {arg}[{name!r}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
        if t.dtype != src.dtype:
            raise TypeError(
                f"{what} must be {src.dtype} like the {name} {relation}, got {t.dtype}; allocate it "
                "with the dtype state_layout gives"
            )
        if t.numel() != src.numel() or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"{what} must be a contiguous flat vector of {src.numel()} elements like the {name} "
                f"{relation}, got shape {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}; "
                "slice it exactly as the state is sliced"
            )
        if t.device != master.device:
            raise ValueError(f"{what} must be on the master's device {master.device}, got {t.device}")
        out[name] = t
    named = {f"{arg}[{k!r}]": t for k, t in out.items()}
    clash = overlapping({**named, **sources, **others}, among=set(named))
    if clash is not None:
        raise ValueError(f"{owner}: {clash[0]} and {clash[1]} overlap in memory; {own_buffers}")
    return out


def check_step_buffers(
    owner: str,
    master: Tensor,
    state: Mapping[str, Tensor],
    others: Mapping[str, Tensor | None],
    *,
    backup_out: Mapping[str, Tensor] | None,
    update_out: Mapping[str, Tensor] | None,
) -> tuple[dict[str, Tensor] | None, bool]:
    """A ``step``'s ``backup_out`` or ``update_out``, checked (``check_buffers``), and whether they are
    ``update_out`` (the update goes there, out of place); (None, False) for neither. Both at once is a
    ValueError: a step either keeps the old values beside an update in place or writes the update
    elsewhere, and the engine asks for one of the two."""
    if backup_out is not None and update_out is not None:
        raise ValueError(
            f"{owner}: step got both backup_out and update_out; pass one: backup_out to keep the old values "
            "beside an update in place, update_out to write the update there and leave master and state "
            "as they were"
        )
    if update_out is not None:
        return check_buffers(owner, "update_out", update_out, master, state, others), True
    if backup_out is not None:
        return check_buffers(owner, "backup_out", backup_out, master, state, others), False
    return None, False


def copy_sources(buffers: Mapping[str, Tensor], master: Tensor, state: Mapping[str, Tensor]) -> None:
    """The copy paths (no C++ kernel): master and state copied into ``buffers`` (checked), before the
    update runs in place, on the sources for a backup, on ``buffers`` for an out-of-place update."""
    buffers["master"].copy_(master)
    for name, t in state.items():
        buffers[name].copy_(t.reshape(-1))
