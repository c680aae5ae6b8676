"""The out-of-place update (``fused_update_out``, ``step(update_out=)``) is the update in place, elsewhere.

For layer_adam, adamw_8bit and adamw_fp8, fused C++ kernels and torch paths: a step given ``update_out``
writes there, bit for bit, what the same step in place writes into master and state, writes ``lowp_out``
alike, and leaves master and state as they were. Several steps in a row, each reading the previous one's
outputs (the engine swaps the two sets of buffers when its bet wins). Sizes around the 128-element
tile of layer_adam's kernel and the 256-element block of adamw_8bit's and adamw_fp8's (1, 127, 128, 129,
256, 1000) and one (70_001) that two threads split into two tasks; slices at odd offsets of larger buffers
(sources and outputs neither aligned nor aligned alike); one and two threads; BF16 and FP32
gradients; with and without the BF16 copy (and, for adamw_fp8, a copy of another dtype or layout, cast
after the update); groups with different weight decays and a tail in none; a unit updated in pieces at
granule offsets, sliced as the engine slices it. The kernels' portable build (memcpy) and AVX2 build
(32-byte streaming stores), both of them adamw_fp8's portable loops instead of its AVX-512 pass, run
the same checks in a child process (test_fused_backup's mechanism). Bad buffers, and ``update_out`` with
``backup_out`` (where ``fused_backup`` is declared too; adamw_fp8's step takes no ``backup_out``), are
refused before anything is written, naming the buffer as ``update_out[...]``.

Test: ``pytest tests/plugins/test_update_out.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_backup import (
    Make,
    _capabilities,
    _groups,
    _inputs,
    _same_bits,
    _unit,
    _view,
    check_in_child,
    each_case,
    fused_kernels,
)
from test_fused_backup import (
    _makers as _backup_makers,
)

from slidekit.capabilities import GRANULE, fuses_backup, updates_out_of_place
from slidekit.engine.state import slice_groups
from slidekit.interfaces import OptimizerHyper, UnitOptimizer
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.adamw_fp8 import AdamWFp8
from slidekit_optim.layer_adam import LayerAdam

#: The optimizers that declare fused_update_out.
OPTIMIZERS = ("layer_adam", "adamw_8bit", "adamw_fp8")

#: Around layer_adam's 128-element tile and the 256-element block of adamw_8bit and adamw_fp8, and
#: large enough (70_001 > 2 x 32 Ki) that two threads each take a task.
SIZES = (1, 127, 128, 129, 256, 1000, 70_001)
#: (source offset, output offset) in elements of the buffers the views are cut from.
OFFSETS = ((0, 0), (3, 5), (1, 0))
STEPS = 3


def _makers(impl: str) -> dict[str, Make]:
    """test_fused_backup's optimizers, and adamw_fp8 (no fused_backup), its torch path in chunks of 4096."""
    return _backup_makers(impl) | {
        "adamw_fp8": lambda threads: AdamWFp8(
            OptimizerHyper(weight_decay=0.1, threads=threads), impl=impl, chunk=4096
        ),
    }


@pytest.fixture(scope="module")
def kernels():
    """Every optimizer of OPTIMIZERS on its C++ kernel (built here if need be), or a skip saying why not."""
    return fused_kernels() | {"adamw_fp8": _makers("cpp")["adamw_fp8"](None)}


def _grad(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gradients over seven decades, so that the moments' blocks hold small and large values."""
    return (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-6, 1, generator=gen)).to(dtype)


def _outputs(like: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """A second set of buffers shaped like ``like``, ``offset`` elements into larger ones, full of 7s."""
    return {k: _view(t.numel(), t.dtype, offset, fill=7) for k, t in like.items()}


def _assert_step(
    what: str,
    out: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    src: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
) -> None:
    """The outputs hold the in-place step's results, the sources their values before the step."""
    for k, t in ref.items():
        assert _same_bits(out[k], t), f"{what}: update_out[{k!r}] differs from the update in place"
    for k, t in before.items():
        assert _same_bits(src[k], t), f"{what}: the source {k} was written"


def check_case(
    make: Make, n: int, offsets: tuple[int, int], grad_dtype: torch.dtype, lowp: bool, threads: int | None
) -> None:
    """``STEPS`` out-of-place steps, each reading the previous one's outputs, against the same steps in
    place: the same bits in the outputs and ``lowp_out``, the sources untouched."""
    ref_opt, opt = make(threads), make(threads)
    assert updates_out_of_place(opt)
    src_at, out_at = offsets
    ref_master, ref_state = _unit(ref_opt, n, src_at)
    ref = {"master": ref_master, **ref_state}
    master, state = _unit(opt, n, src_at)
    src = {"master": master, **state}
    out = _outputs(src, out_at)
    ref_low, low = _view(n, torch.bfloat16, src_at), _view(n, torch.bfloat16, out_at)
    gen, groups = torch.Generator().manual_seed(2), _groups(n)
    what = f"{type(opt).__name__} n={n} offsets={offsets} grad={grad_dtype} lowp={lowp} threads={threads}"
    for count in range(1, STEPS + 1):
        grad, lr = _grad(n, grad_dtype, gen), 1e-3 / count
        before = {k: t.clone() for k, t in src.items()}
        ref_opt.step(
            ref["master"], grad, {k: ref[k] for k in ref_state}, lr=lr, count=count, groups=groups,
            lowp_out=ref_low if lowp else None,
        )  # fmt: skip
        opt.step(
            src["master"], grad, {k: src[k] for k in state}, lr=lr, count=count, groups=groups,
            lowp_out=low if lowp else None, update_out=out,
        )  # fmt: skip
        _assert_step(f"{what}, step {count}", out, ref, src, before)
        if lowp:
            assert _same_bits(low, ref_low), f"{what}, step {count}: lowp_out differs"
        assert not _same_bits(out["master"], before["master"]), (
            f"{what}, step {count}: the master never moved"
        )
        src, out = out, src  # the engine's swap: the outputs are the next step's sources


def check_all(impl: str, optimizer: str, threads: int | None) -> int:
    """Every size, offset pair, gradient dtype, with and without lowp_out; returns the cases run."""
    return each_case(check_case, _makers(impl)[optimizer], SIZES, OFFSETS, threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_kernel_update_out_is_the_update_in_place(kernels, optimizer, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # two tasks even on one core: the split is what is under test
    try:
        assert check_all("cpp", optimizer, threads) == len(SIZES) * len(OFFSETS) * 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_torch_path_update_out_is_the_update_in_place(optimizer):
    check_all("torch", optimizer, None)


@pytest.mark.parametrize("capability", _capabilities())
def test_other_isa_builds(kernels, capability):
    """The kernels built without vector ISA flags (memcpy) and for AVX2 (32-byte streaming stores): the
    same checks, in a child process under that capability, at two threads."""
    cases = check_in_child(capability, "test_update_out", OPTIMIZERS)
    assert cases == len(OPTIMIZERS) * len(SIZES) * len(OFFSETS) * 2


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_fp8"])
@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize(
    "lowp", ["float16", "float32", "strided"], ids=["fp16", "fp32", "bf16-not-contiguous"]
)
def test_a_copy_cast_after_the_update_is_cast_from_the_update(kernels, name, impl, lowp):
    """adamw_8bit and adamw_fp8 write a BF16 contiguous ``lowp_out`` in their pass and cast any other from
    the master after the update: out of place, from ``update_out['master']``, the sources staying as they
    were (layer_adam refuses such a ``lowp_out``)."""
    n = 1000
    ref_opt, opt = _makers(impl)[name](None), _makers(impl)[name](None)
    ref_master, ref_state = _unit(ref_opt, n, 0)
    master, state = _unit(opt, n, 0)
    src = {"master": master, **state}
    out = _outputs(src, 3)

    def copy() -> torch.Tensor:
        if lowp == "strided":
            return torch.zeros(2 * n, dtype=torch.bfloat16)[::2]
        return torch.zeros(n, dtype=getattr(torch, lowp))

    ref_low, low = copy(), copy()
    gen, groups = torch.Generator().manual_seed(5), _groups(n)
    for count in (1, 2):
        grad = _grad(n, torch.bfloat16, gen)
        before = {k: t.clone() for k, t in src.items()}
        ref_opt.step(ref_master, grad, ref_state, lr=1e-3, count=count, groups=groups, lowp_out=ref_low)
        opt.step(
            src["master"], grad, {k: src[k] for k in state}, lr=1e-3, count=count, groups=groups,
            lowp_out=low, update_out=out,
        )  # fmt: skip
        what = f"{name} ({impl}) lowp_out {lowp}, step {count}"
        _assert_step(what, out, {"master": ref_master, **ref_state}, src, before)
        assert _same_bits(low.contiguous(), ref_low.contiguous()), f"{what}: lowp_out differs from in place's"
        src, out = out, src


# --------------------------------------------------------------------------- a unit in pieces


def _piece(opt: UnitOptimizer, whole: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Master and state of parameters [lo, hi) of a unit, sliced from its whole buffers as the engine
    slices a unit with linear state: each state buffer from the offset ``state_layout(lo)`` gives, as
    long as ``state_layout(hi - lo)`` says."""
    at, size = opt.state_layout(lo), opt.state_layout(hi - lo)
    out = {"master": whole["master"][lo:hi]}
    return out | {k: whole[k][at[k][1] : at[k][1] + c] for k, (_, c) in size.items()}


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_pieces_sliced_as_the_engine_slices_them(kernels, optimizer, impl):
    """A unit updated out of place in three pieces at granule offsets, the sources and the outputs sliced
    from whole buffers alike: two steps, outputs swapped in between, each the same bits as the whole unit
    updated in place in one call; the sources untouched."""
    n = 3 * GRANULE + 1000
    cuts = [(0, GRANULE), (GRANULE, 3 * GRANULE), (3 * GRANULE, n)]
    ref_opt, opt = _makers(impl)[optimizer](None), _makers(impl)[optimizer](None)
    ref_master, ref_state = _unit(ref_opt, n, 3)
    master, state = _unit(opt, n, 3)
    src, out = {"master": master, **state}, _outputs({"master": master, **state}, 5)
    ref_low, low = _view(n, torch.bfloat16, 0), _view(n, torch.bfloat16, 1)
    gen, groups = torch.Generator().manual_seed(4), _groups(n)
    for count in (1, 2):
        grad = _grad(n, torch.float32, gen)
        ref_opt.step(ref_master, grad, ref_state, lr=1e-3, count=count, groups=groups, lowp_out=ref_low)
        before = {k: t.clone() for k, t in src.items()}
        for lo, hi in cuts:
            piece, piece_out = _piece(opt, src, lo, hi), _piece(opt, out, lo, hi)
            opt.step(
                piece["master"], grad[lo:hi], {k: piece[k] for k in state}, lr=1e-3, count=count,
                groups=slice_groups(groups, lo, hi), lowp_out=low[lo:hi], update_out=piece_out,
            )  # fmt: skip
        _assert_step(
            f"{optimizer} ({impl}) in pieces, step {count}",
            out,
            {"master": ref_master, **ref_state},
            src,
            before,
        )
        assert _same_bits(low, ref_low), f"{optimizer} ({impl}) in pieces, step {count}: lowp_out differs"
        src, out = out, src


# --------------------------------------------------------------------------- bad buffers


def test_the_optimizers_declare_it():
    assert LayerAdam.fused_update_out is True and AdamW8bit.fused_update_out is True
    assert LayerAdam.fused_backup is True and AdamW8bit.fused_backup is True  # the protocol it extends
    assert AdamWFp8.fused_update_out is True  # out of place only: the engine then never backs up in place
    assert not fuses_backup(AdamWFp8(OptimizerHyper(), impl="torch"))


def _overlapping_view(of: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A ``numel``-element ``dtype`` vector over the first bytes of ``of``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return of.view(torch.uint8)[: numel * itemsize].view(dtype)


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_bad_update_buffers_are_refused_before_any_write(kernels, optimizer, impl):
    opt = _makers(impl)[optimizer](None)
    state_name = next(iter(opt.state_layout(1)))
    master, grad, state, good = _inputs(opt)
    for t in good.values():
        t.view(torch.uint8).fill_(7)
    written = {"master": master, **state, **{f"update_out[{k!r}]": t for k, t in good.items()}}
    start = {k: t.clone() for k, t in written.items()}

    def refused(update_out, error, match, backup_out=None):
        backup = {} if backup_out is None else {"backup_out": backup_out}  # adamw_fp8's step takes none
        with pytest.raises(error, match=match):
            opt.step(
                master, grad, state, lr=1e-3, count=1, groups=_groups(1000), update_out=update_out, **backup
            )  # fmt: skip
        for k, t in written.items():
            assert _same_bits(t, start[k]), f"a refused step must write nothing; it wrote {k}"

    spare = {k: torch.empty_like(t) for k, t in good.items()}
    if fuses_backup(opt):
        refused(good, ValueError, "both backup_out and update_out; pass one", backup_out=spare)
    else:
        refused(good, TypeError, "backup_out", backup_out=spare)
    lacking = {k: t for k, t in good.items() if k != state_name}
    refused(lacking, ValueError, rf"update_out must name 'master'.*lacks \['{state_name}'\]")
    refused({**good, "momentum": torch.empty(1000)}, ValueError, r"update_out .*unknown \['momentum'\]")
    wide = torch.empty(1000, dtype=torch.float64)
    refused({**good, "master": wide}, TypeError, r"update_out\['master'\] must be torch.float32")
    refused({**good, "master": torch.empty(999)}, ValueError, r"update_out\['master'\].*1000 elements")
    strided = torch.empty(2000)[::2]
    refused({**good, "master": strided}, ValueError, r"update_out\['master'\].*\(not contiguous\)")
    meta = torch.empty(1000, device="meta")
    refused({**good, "master": meta}, ValueError, r"update_out\['master'\] must be on the master's device")
    refused({**good, "master": master}, ValueError, r"update_out\['master'\] and master overlap")
    refused(
        {**good, state_name: state[state_name]}, ValueError, rf"update_out\['{state_name}'\] and {state_name}"
    )
    refused({**good, "master": grad}, ValueError, r"update_out\['master'\] and grad overlap")
    dtype, numel = state[state_name].dtype, state[state_name].numel()
    shared = _overlapping_view(good["master"], dtype, numel)
    refused(
        {**good, state_name: shared}, ValueError,
        rf"update_out\['master'\] and update_out\['{state_name}'\] overlap in memory; the update's outputs",
    )  # fmt: skip
