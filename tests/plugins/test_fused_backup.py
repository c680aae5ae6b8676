"""The backup written in the update's pass (``fused_backup``, ``step(backup_out=)``) is exact.

For layer_adam and adamw_8bit, fused C++ kernels and torch paths: after every step the backup holds
the master and state as they were before it, bit for bit, and the update is bit for bit the update
without a backup. Sizes around the vector widths (16 lanes, 64-element task edges), the 128-element
backup tile and the 256-element quantization block; slices at odd offsets of larger buffers (so
neither the sources nor the backups are aligned, nor aligned alike); one and two threads; BF16 and
FP32 gradients; with and without the BF16 copy; groups with different weight decays. The kernels'
portable build (ATEN_CPU_CAPABILITY=default: memcpy, no streaming stores) and AVX2 build (32-byte
streaming stores) run the same checks in a child process; the build here runs the AVX-512 stores
where this CPU has them. Bad buffers are refused before anything is written, naming the buffer.

Test: ``pytest tests/plugins/test_fused_backup.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from slidekit.capabilities import check_optimizer, fuses_backup
from slidekit.errors import PluginError
from slidekit.interfaces import FusedBackupOptimizer, OptimizerHyper, ParamGroupRange, UnitOptimizer
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.kernel_build import kernel_status
from slidekit_optim.layer_adam import LayerAdam

#: Around 16 lanes, 64-element task edges, the 128-element tile and 256-element blocks, and large
#: enough (100_003 > 2 x 32 Ki) that two threads each take a task.
SIZES = (1, 15, 17, 63, 129, 255, 257, 513, 4099, 100_003)
#: (source offset, backup offset) in elements of the buffers the views are cut from.
OFFSETS = ((0, 0), (3, 5), (1, 0))
STEPS = 3

Make = Callable[[int | None], UnitOptimizer]


def _makers(impl: str) -> dict[str, Make]:
    return {
        "layer_adam": lambda threads: LayerAdam(OptimizerHyper(weight_decay=0.1, threads=threads), impl=impl),
        "adamw_8bit": lambda threads: AdamW8bit(
            OptimizerHyper(weight_decay=0.1, threads=threads), impl=impl, chunk=4096
        ),
    }


def _groups(n: int) -> list[ParamGroupRange]:
    """Three decays (one of them none) and, for n >= 10, a tail in no group; edges off every width."""
    if n < 10:
        return [ParamGroupRange(start=0, stop=n, weight_decay=0.05)]
    a, b, c = int(n * 0.3), int(n * 0.6), int(n * 0.9)
    return [
        ParamGroupRange(start=0, stop=a, weight_decay=0.1),
        ParamGroupRange(start=a, stop=b, weight_decay=0.0),
        ParamGroupRange(start=b, stop=c, weight_decay=0.02),
    ]


def _view(numel: int, dtype: torch.dtype, offset: int, fill: float = 0.0) -> torch.Tensor:
    """A contiguous vector of ``numel`` elements starting ``offset`` elements into a larger buffer."""
    return torch.full((numel + offset + 7,), fill, dtype=dtype)[offset : offset + numel]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _unit(opt: UnitOptimizer, n: int, offset: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    master = _view(n, torch.float32, offset)
    master.copy_(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    state = {k: _view(c, dt, offset) for k, (dt, c) in opt.state_layout(n).items()}
    return master, state


def check_case(
    make: Make, n: int, offsets: tuple[int, int], grad_dtype: torch.dtype, lowp: bool, threads: int | None
) -> None:
    """``STEPS`` steps with a backup against the same steps without: same bits, exact backups."""
    plain_opt, backed_opt = make(threads), make(threads)
    assert isinstance(backed_opt, FusedBackupOptimizer) and fuses_backup(backed_opt)
    src, dst = offsets
    (pm, ps), (bm, bs) = _unit(plain_opt, n, src), _unit(backed_opt, n, src)
    p_low, b_low = _view(n, torch.bfloat16, src), _view(n, torch.bfloat16, src)
    backup = {"master": _view(n, torch.float32, dst, fill=7.0)}
    backup |= {k: _view(t.numel(), t.dtype, dst, fill=7) for k, t in bs.items()}
    gen, groups = torch.Generator().manual_seed(2), _groups(n)
    what = f"{type(backed_opt).__name__} n={n} offsets={offsets} grad={grad_dtype} lowp={lowp}"
    what += f" threads={threads}"
    for count in range(1, STEPS + 1):
        grad = (torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-6, 1, generator=gen)).to(
            grad_dtype
        )
        before = {"master": bm.clone(), **{k: t.clone() for k, t in bs.items()}}
        lr = 1e-3 / count
        plain_opt.step(pm, grad, ps, lr=lr, count=count, groups=groups, lowp_out=p_low if lowp else None)
        b_out = b_low if lowp else None
        backed_opt.step(bm, grad, bs, lr=lr, count=count, groups=groups, lowp_out=b_out, backup_out=backup)
        for k, t in before.items():
            assert _same_bits(backup[k], t), f"{what}, step {count}: the backup of {k} is not the old value"
        assert _same_bits(bm, pm), f"{what}, step {count}: the master differs from the update without backup"
        for k in ps:
            assert _same_bits(bs[k], ps[k]), f"{what}, step {count}: state {k} differs"
        if lowp:
            assert _same_bits(b_low, p_low), f"{what}, step {count}: lowp_out differs"
    assert not _same_bits(bm, before["master"]) or n == 0, f"{what}: the master never moved"


def each_case(
    check: Callable[..., None], make: Make, sizes: tuple[int, ...], offsets: tuple[tuple[int, int], ...],
    threads: int | None,
) -> int:  # fmt: skip
    """``check(make, n, offsets, grad_dtype, lowp=, threads=)`` for every size, offset pair and gradient
    dtype, lowp_out on every other (size, offsets) pair; returns the cases run (this file's ``check_all``
    and test_update_out.py's)."""
    cases = 0
    for i, n in enumerate(sizes):
        for j, pair in enumerate(offsets):
            for grad_dtype in (torch.bfloat16, torch.float32):
                check(make, n, pair, grad_dtype, lowp=(i + j) % 2 == 0, threads=threads)
                cases += 1
    return cases


def check_all(impl: str, optimizer: str, threads: int | None) -> int:
    """Every size, offset pair, gradient dtype, with and without lowp_out; returns the cases run."""
    return each_case(check_case, _makers(impl)[optimizer], SIZES, OFFSETS, threads)


def fused_kernels() -> dict[str, UnitOptimizer]:
    """Both optimizers on their C++ kernels (built here if need be), or a skip saying why they cannot be
    built (test_update_out.py's fixture too)."""
    status = kernel_status()
    if status.startswith("pure torch (no C++ compiler") or status.startswith("pure torch (ninja"):
        pytest.skip(status)
    return {name: make(None) for name, make in _makers("cpp").items()}


@pytest.fixture(scope="module")
def kernels():
    return fused_kernels()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_kernel_backup_is_exact_and_changes_no_bit(kernels, optimizer, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # two tasks even on one core: the split is what is under test
    try:
        assert check_all("cpp", optimizer, threads) == len(SIZES) * len(OFFSETS) * 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_torch_path_backup_is_exact_and_changes_no_bit(optimizer):
    check_all("torch", optimizer, None)


def _capabilities() -> list[str]:
    """The ATen CPU capabilities below this machine's: each builds the kernels with other stores."""
    have = str(torch.backends.cpu.get_cpu_capability()).lower()
    ladder = ["default", "avx2", "avx512"]
    return ladder[: ladder.index(have)] if have in ladder else ["default"]


def check_in_child(
    capability: str, module: str, optimizers: tuple[str, ...] = ("layer_adam", "adamw_8bit")
) -> int:
    """``module``'s ``check_all`` (this file's, or test_update_out.py's) for the ``optimizers``' kernels at
    two threads, in a child process under ATEN_CPU_CAPABILITY=``capability``, which builds the kernels for
    it; checks that the child runs that capability and its stores (memcpy for "default", 32-byte streaming
    stores for "avx2"), and returns the cases run."""
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import {module} as t; "
        "from slidekit_optim.layer_adam import LayerAdam; from slidekit.interfaces import OptimizerHyper; "
        "print(torch.backends.cpu.get_cpu_capability()); "
        "print(LayerAdam(OptimizerHyper(), impl='cpp')._kernel.backup_stream_bytes()); "
        "torch.set_num_threads(2); "
        f"print(sum(t.check_all('cpp', o, 2) for o in {optimizers!r}))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    # The timeout only turns a hang into a failure: the child may build both kernels from cold.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got_capability, stream_bytes, cases = done.stdout.split()[-3:]
    assert got_capability.lower() == capability
    assert int(stream_bytes) == {"default": 0, "avx2": 32}[capability]
    return int(cases)


@pytest.mark.parametrize("capability", _capabilities())
def test_other_isa_builds(kernels, capability):
    """The kernels built without vector ISA flags (memcpy) and for AVX2 (32-byte streaming stores): the
    same checks, in a child process under that capability, at two threads."""
    assert check_in_child(capability, "test_fused_backup") == 2 * len(SIZES) * len(OFFSETS) * 2


def test_this_build_streams_where_the_cpu_has_avx512(kernels):
    width = kernels["layer_adam"]._kernel.backup_stream_bytes()
    assert width == kernels["adamw_8bit"]._kernel.backup_stream_bytes()
    cap = str(torch.backends.cpu.get_cpu_capability()).lower()
    assert width == {"avx512": 64, "avx2": 32}.get(cap, 0)


# --------------------------------------------------------------------------- bad buffers


def _inputs(opt: UnitOptimizer, n: int = 1000):
    master, state = _unit(opt, n, 0)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(3))
    backup = {"master": torch.empty(n), **{k: torch.empty_like(t) for k, t in state.items()}}
    return master, grad, state, backup


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_bad_backup_buffers_are_refused_before_any_write(kernels, optimizer, impl):
    opt = _makers(impl)[optimizer](None)
    state_name = next(iter(opt.state_layout(1)))
    master, grad, state, good = _inputs(opt)
    start = master.clone()

    def refused(backup, error, match):
        with pytest.raises(error, match=match):
            opt.step(master, grad, state, lr=1e-3, count=1, groups=_groups(1000), backup_out=backup)
        assert _same_bits(master, start), "a refused step must write nothing"

    refused({k: t for k, t in good.items() if k != state_name}, ValueError, rf"lacks \['{state_name}'\]")
    refused({**good, "momentum": torch.empty(1000)}, ValueError, r"unknown \['momentum'\]")
    wide = torch.empty(1000, dtype=torch.float64)
    refused({**good, "master": wide}, TypeError, r"backup_out\['master'\].*float32")
    refused({**good, "master": torch.empty(999)}, ValueError, r"backup_out\['master'\].*1000 elements")
    refused({**good, "master": torch.empty(2000)[::2]}, ValueError, r"backup_out\['master'\].*not contiguous")
    refused({**good, "master": master}, ValueError, r"backup_out\['master'\] and master overlap")
    refused({**good, state_name: state[state_name]}, ValueError, "overlap in memory")


def test_the_capability_is_optional_and_a_bool():
    class Plain:
        name, device_update, linear_state = "plain", False, True

        def state_layout(self, numel):
            return {"buf": (torch.float32, numel)}

        def step(self, master, grad, state, *, lr, count, groups, lowp_out=None):
            pass

    assert not fuses_backup(Plain()) and not isinstance(Plain(), FusedBackupOptimizer)
    check_optimizer(Plain(), who="optimizer 'plain'")  # not declaring it is fine
    plain = Plain()
    plain.fused_backup = "yes"
    with pytest.raises(PluginError, match=r"fused_backup = 'yes'.*not a bool"):
        check_optimizer(plain, who="optimizer 'plain'")
    assert LayerAdam.fused_backup is True and AdamW8bit.fused_backup is True


def test_the_conformance_kit_holds_a_fused_backup_to_its_word():
    from slidekit.testing import optimizers as kit

    kit.check_fused_backup(lambda: LayerAdam(OptimizerHyper(weight_decay=0.1), impl="torch"))

    class Late(LayerAdam):
        """Takes the backup after the update: the new values, not the old ones."""

        def step(self, master, grad, state, *, backup_out=None, **kw):
            super().step(master, grad, state, **kw)
            if backup_out is not None:
                backup_out["master"].copy_(master)
                for k, t in state.items():
                    backup_out[k].copy_(t)

    with pytest.raises(AssertionError, match=r"backup_out\['master'\] against the value before"):
        kit.check_fused_backup(lambda: Late(OptimizerHyper(weight_decay=0.1), impl="torch"))
