"""Conformance checks any per-unit optimizer must pass (bundled or third-party).

All at once::

    from slidekit.testing.optimizers import check_optimizer
    check_optimizer(lambda: MyAdam(OptimizerHyper(weight_decay=0.1)))

or one test per check, so pytest reports each on its own::

    from slidekit.testing.optimizers import CHECKS

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        check(lambda: MyAdam(OptimizerHyper(weight_decay=0.1)))

Each check builds a fresh optimizer from the factory. A check that does not
apply (a capability declared False) raises ``NotApplicable``, one that needs
what this machine lacks (a CUDA device) ``unittest.SkipTest``: pytest reports
either as a skip. ``check_optimizer`` tells them apart: a check that does not
apply is no gap, but a skipped one is not a pass, so once every other check
has run it raises ``unittest.SkipTest`` listing what was skipped and why,
unless the skipped check is allowed (``allow_skips=DEVICE_CHECKS`` on a
CPU-only machine). It returns the ``Conformance``
(``slidekit.testing.conformance``).

What an optimizer is held to, beyond the ``UnitOptimizer`` docstring:

* ``check_declarations``: ``device_update`` and ``linear_state`` are declared,
  as bools, and a declared ``linear_state = True`` agrees with
  ``state_layout`` (``slidekit.capabilities.check_optimizer``, the check every
  run makes when it builds the optimizer);
* ``check_step``: ``step`` updates the master and the state in place (the
  engine keeps the tensors it passed), leaves them finite, and writes the
  updated master, cast, to ``lowp_out``;
* ``check_linear_state`` (``linear_state = True``): updating a unit in pieces
  that start at multiples of ``GRANULE``, each piece on its slice of the
  state (at ``state_layout(a)``'s offsets, ``state_layout(m)``'s size), gives
  bit for bit what one whole update gives, step after step: this is how the
  engine updates a unit whose state it streams or whose gradients come down
  in pieces;
* ``check_device_update`` (``device_update = True``, on a CUDA machine):
  ``step`` runs on CUDA tensors and gives bit for bit what it gives on the
  CPU, so results never depend on where the engine kept a unit;
* ``check_fused_backup`` (``fused_backup = True``, optional): ``step`` with
  ``backup_out`` leaves there the master and state as they were before the
  step, bit for bit, and updates them bit for bit as without it;
* ``check_update_out`` (``fused_update_out = True``, optional): ``step`` with
  ``update_out`` writes there, bit for bit, what a step in place leaves in the
  master and state, leaves those as they were, and refuses ``backup_out``
  beside it. Step after step, the outputs taken as the next step's inputs, as
  the engine's swap does.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import torch

from slidekit.capabilities import GRANULE
from slidekit.capabilities import check_optimizer as check_capabilities
from slidekit.engine.state import slice_groups
from slidekit.interfaces import FusedBackupOptimizer, ParamGroupRange, UnitOptimizer
from slidekit.testing.conformance import Conformance, NotApplicable, run_checks

__all__ = [
    "CHECKS",
    "DEVICE_CHECKS",
    "GROUPS",
    "NUMEL",
    "OptimizerFactory",
    "check_declarations",
    "check_device_update",
    "check_fused_backup",
    "check_linear_state",
    "check_optimizer",
    "check_step",
    "check_update_out",
]

OptimizerFactory = Callable[[], UnitOptimizer]

#: The unit the checks update: three granules and an odd tail.
NUMEL = 3 * GRANULE + 777
#: Its parameter groups: decaying and not, with edges inside the pieces ``check_linear_state`` cuts
#: and one range (the last 100 elements) in no group at all.
GROUPS = (
    ParamGroupRange(start=0, stop=1000, weight_decay=0.1),
    ParamGroupRange(start=1000, stop=GRANULE + 5, weight_decay=0.0),
    ParamGroupRange(start=GRANULE + 5, stop=NUMEL - 100, weight_decay=0.05),
)
#: Pieces ``check_linear_state`` cuts the unit into: each starts at a multiple of ``GRANULE``.
PIECES = ((0, GRANULE), (GRANULE, 3 * GRANULE), (3 * GRANULE, NUMEL))
STEPS = 3
LR = 1e-3

State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- helpers


def _name(opt: UnitOptimizer) -> str:
    return str(getattr(opt, "name", type(opt).__name__))


def _unit(seed: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An FP32 master and ``STEPS`` BF16 gradients of ``NUMEL`` elements, seeded."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(NUMEL, generator=gen)
    grads = [(torch.randn(NUMEL, generator=gen) * 1e-2).bfloat16() for _ in range(STEPS)]
    return master.to(device), [g.to(device) for g in grads]


def _zero_state(opt: UnitOptimizer, numel: int, device: torch.device | str = "cpu") -> State:
    return {k: torch.zeros(n, dtype=dt, device=device) for k, (dt, n) in opt.state_layout(numel).items()}


def _assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bitwise equality, naming the first element that differs and by how much."""
    a, b = got.detach().cpu().reshape(-1), want.detach().cpu().reshape(-1)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype} {tuple(a.shape)}, expected {b.dtype} {tuple(b.shape)}")
    differ = a.view(torch.uint8).reshape(a.numel(), -1) != b.view(torch.uint8).reshape(b.numel(), -1)
    bad = differ.any(dim=1).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ, first at {i} "
            f"(got {a[i].item()!r}, expected {b[i].item()!r})"
        )


def _run(
    opt: UnitOptimizer,
    master: torch.Tensor,
    grads: Sequence[torch.Tensor],
    state: Mapping[str, torch.Tensor],
    lowp: torch.Tensor,
    pieces: Sequence[tuple[int, int]] = ((0, NUMEL),),
) -> None:
    """``STEPS`` updates of the unit, each as one ``step`` per piece on the piece's slice of everything."""
    offsets = [{k: n for k, (_, n) in opt.state_layout(a).items()} for a, _ in pieces]
    sizes = [{k: n for k, (_, n) in opt.state_layout(b - a).items()} for a, b in pieces]
    for count, grad in enumerate(grads, 1):
        lr = LR * (1 - count / (2 * len(grads)))  # a schedule: each step its own learning rate
        for (a, b), off, size in zip(pieces, offsets, sizes, strict=True):
            opt.step(
                master[a:b],
                grad[a:b],
                {k: t[off[k] : off[k] + size[k]] for k, t in state.items()},
                lr=lr,
                count=count,
                groups=slice_groups(GROUPS, a, b),
                lowp_out=lowp[a:b],
            )


# --------------------------------------------------------------------------- the checks


def check_declarations(make: OptimizerFactory) -> None:
    """``device_update`` and ``linear_state`` are bools, and ``linear_state`` agrees with ``state_layout``."""
    opt = make()
    try:
        check_capabilities(opt, who=f"optimizer {_name(opt)!r}")
    except Exception as exc:
        raise AssertionError(str(exc)) from exc


def check_step(make: OptimizerFactory) -> None:
    """``step`` updates master and state in place, keeps them finite, and writes the cast master to lowp_out."""
    opt = make()
    name = _name(opt)
    master, grads = _unit(0)
    before = master.clone()
    state = _zero_state(opt, NUMEL)
    held = {k: (t, t.data_ptr()) for k, t in state.items()}
    lowp = torch.empty(NUMEL, dtype=torch.bfloat16)
    _run(opt, master, grads, state, lowp)
    if torch.equal(master, before):
        raise AssertionError(f"{name}: {STEPS} steps left the master unchanged")
    if not bool(master.isfinite().all()):
        raise AssertionError(f"{name}: the master is not finite after {STEPS} steps")
    _assert_bits(lowp, master.to(lowp.dtype), f"{name}: lowp_out against the updated master cast to BF16")
    for k, (t, ptr) in held.items():
        if state[k] is not t or t.data_ptr() != ptr:
            raise AssertionError(f"{name}: state {k!r} was replaced; step must update it in place")
        if t.is_floating_point() and not bool(t.isfinite().all()):
            raise AssertionError(f"{name}: state {k!r} is not finite after {STEPS} steps")
    if state and all(not bool(t.any()) for t in state.values()):
        raise AssertionError(f"{name}: the state is still all zero after {STEPS} steps")


def check_linear_state(make: OptimizerFactory) -> None:
    """With ``linear_state = True``: the unit updated in pieces gives the bits of the unit updated whole."""
    opt = make()
    name = _name(opt)
    if opt.linear_state is not True:
        raise NotApplicable(f"{name} declares linear_state = False: the engine updates its units whole")
    init, grads = _unit(1)
    runs = []
    for pieces in (((0, NUMEL),), PIECES):
        master, state = init.clone(), _zero_state(opt, NUMEL)
        lowp = torch.empty(NUMEL, dtype=torch.bfloat16)
        _run(make(), master, grads, state, lowp, pieces)
        runs.append((master, state, lowp))
    (m_whole, s_whole, l_whole), (m_pieces, s_pieces, l_pieces) = runs
    cut = ", ".join(f"[{a}, {b})" for a, b in PIECES)
    what = f"{name} (linear_state = True), updated in pieces {cut} against whole"
    _assert_bits(m_pieces, m_whole, f"{what}: master")
    _assert_bits(l_pieces, l_whole, f"{what}: lowp_out")
    for k in s_whole:
        _assert_bits(s_pieces[k], s_whole[k], f"{what}: state {k!r}")


def check_device_update(make: OptimizerFactory) -> None:
    """With ``device_update = True``: ``step`` on CUDA tensors gives the bits of ``step`` on the CPU."""
    opt = make()
    name = _name(opt)
    if opt.device_update is not True:
        raise NotApplicable(f"{name} declares device_update = False: its units stay on the host")
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for where in ("cpu", device):
        master, grads = _unit(2, where)
        state = _zero_state(opt, NUMEL, where)
        lowp = torch.empty(NUMEL, dtype=torch.bfloat16, device=where)
        _run(make(), master, grads, state, lowp)
        if where != "cpu":
            torch.cuda.synchronize(device)
            for label, t in {"master": master, "lowp_out": lowp, **state}.items():
                if t.device != device:
                    raise AssertionError(f"{name}: {label} left {device} for {t.device} during step")
        results.append((master, state, lowp))
    (m_cpu, s_cpu, l_cpu), (m_dev, s_dev, l_dev) = results
    what = f"{name} (device_update = True), {STEPS} steps on {device} against the CPU"
    _assert_bits(m_dev, m_cpu, f"{what}: master")
    _assert_bits(l_dev, l_cpu, f"{what}: lowp_out")
    for k in s_cpu:
        _assert_bits(s_dev[k], s_cpu[k], f"{what}: state {k!r}")


def check_fused_backup(make: OptimizerFactory) -> None:
    """With ``fused_backup = True``: ``backup_out`` receives the old master and state exactly, and the
    update is the same bits as without it."""
    opt = make()
    name = _name(opt)
    if getattr(opt, "fused_backup", False) is not True:
        raise NotApplicable(
            f"{name} does not declare fused_backup = True: the engine copies its backups (where it does not "
            "update out of place, fused_update_out)"
        )
    plain, backed = make(), cast(FusedBackupOptimizer, make())
    init, grads = _unit(3)
    pm, bm = init.clone(), init.clone()
    ps, bs = _zero_state(plain, NUMEL), _zero_state(backed, NUMEL)
    p_low, b_low = torch.empty(NUMEL, dtype=torch.bfloat16), torch.empty(NUMEL, dtype=torch.bfloat16)
    backup = {"master": torch.full_like(bm, 7.0), **{k: torch.full_like(t, 7) for k, t in bs.items()}}
    what = f"{name} (fused_backup = True)"
    for count, grad in enumerate(grads, 1):
        before = {"master": bm.clone(), **{k: t.clone() for k, t in bs.items()}}
        plain.step(pm, grad, ps, lr=LR, count=count, groups=GROUPS, lowp_out=p_low)
        backed.step(bm, grad, bs, lr=LR, count=count, groups=GROUPS, lowp_out=b_low, backup_out=backup)
        for k, t in before.items():
            _assert_bits(backup[k], t, f"{what}, step {count}: backup_out[{k!r}] against the value before")
        _assert_bits(bm, pm, f"{what}, step {count}: master against a step without backup_out")
        _assert_bits(b_low, p_low, f"{what}, step {count}: lowp_out against a step without backup_out")
        for k in ps:
            _assert_bits(bs[k], ps[k], f"{what}, step {count}: state {k!r} against a step without backup_out")


def check_update_out(make: OptimizerFactory) -> None:
    """With ``fused_update_out = True``: ``update_out`` receives exactly what a step in place leaves in the
    master and state, ``lowp_out`` the same, the inputs stay as they were, and ``backup_out`` beside it is
    refused (where ``fused_backup`` is declared too). The outputs are the next step's inputs (the engine
    swaps them in)."""
    opt = make()
    name = _name(opt)
    if getattr(opt, "fused_update_out", False) is not True:
        raise NotApplicable(f"{name} does not declare fused_update_out = True: speculation backs up in place")
    plain, out_of_place = make(), cast(FusedBackupOptimizer, make())
    init, grads = _unit(4)
    pm, om = init.clone(), init.clone()
    ps, os_ = _zero_state(plain, NUMEL), _zero_state(out_of_place, NUMEL)
    p_low, o_low = torch.empty(NUMEL, dtype=torch.bfloat16), torch.empty(NUMEL, dtype=torch.bfloat16)
    what = f"{name} (fused_update_out = True)"
    for count, grad in enumerate(grads, 1):
        out = {"master": torch.full_like(om, 7.0), **{k: torch.full_like(t, 7) for k, t in os_.items()}}
        before = {"master": om.clone(), **{k: t.clone() for k, t in os_.items()}}
        plain.step(pm, grad, ps, lr=LR, count=count, groups=GROUPS, lowp_out=p_low)
        out_of_place.step(om, grad, os_, lr=LR, count=count, groups=GROUPS, lowp_out=o_low, update_out=out)
        _assert_bits(om, before["master"], f"{what}, step {count}: master, which update_out leaves as it was")
        for k in os_:
            kept = f"{what}, step {count}: state {k!r}, which update_out leaves as it was"
            _assert_bits(os_[k], before[k], kept)
        _assert_bits(out["master"], pm, f"{what}, step {count}: update_out['master'] against a step in place")
        _assert_bits(o_low, p_low, f"{what}, step {count}: lowp_out against a step in place")
        for k in ps:
            _assert_bits(out[k], ps[k], f"{what}, step {count}: update_out[{k!r}] against a step in place")
        om, os_ = out["master"], {k: out[k] for k in os_}  # the engine's swap
    if getattr(out_of_place, "fused_backup", False) is not True:
        return  # its step takes no backup_out at all
    both = {"master": torch.empty_like(om), **{k: torch.empty_like(t) for k, t in os_.items()}}
    copy = {k: torch.empty_like(t) for k, t in both.items()}
    try:
        out_of_place.step(
            om, grads[0], os_, lr=LR, count=len(grads) + 1, groups=GROUPS, backup_out=both, update_out=copy
        )
    except ValueError:
        return
    raise AssertionError(f"{what}: step() took backup_out and update_out together; it must refuse them")


CHECKS: tuple[Callable[[OptimizerFactory], None], ...] = (
    check_declarations,
    check_step,
    check_linear_state,
    check_device_update,
    check_fused_backup,
    check_update_out,
)


#: The checks that need a CUDA device (skipped without one, for an optimizer declaring device_update).
DEVICE_CHECKS: tuple[str, ...] = ("check_device_update",)


def check_optimizer(
    make: OptimizerFactory, *, allow_skips: Collection[Callable[..., Any] | str] = ()
) -> Conformance:
    """Run every check against fresh optimizers from ``make``; raise AssertionError on the first failure.

    A check of a capability the optimizer does not declare (``NotApplicable``) is passed over. One this
    machine cannot run (``unittest.SkipTest``) is not a pass: once the others have run,
    ``unittest.SkipTest`` is raised naming it and why, unless it is in ``allow_skips`` (check functions
    or names, e.g. ``DEVICE_CHECKS``). Returns what passed, what was skipped and what does not apply.
    """
    return run_checks(CHECKS, make, driver=f"optimizer {_name(make())!r}", allow_skips=allow_skips)
