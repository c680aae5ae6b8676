"""adamw_8bit: the fused C++ kernel (csrc/adamw8.cpp) and the torch path agree bit for bit.

Master, BF16 copy, both moments' codes and block scales are compared bit for
bit after many steps: sizes from below one block to many blocks, never a
multiple of the block size except 256 itself; gradients FP32 and BF16 spanning
1e-8..1e15 with exact zeros and a block that stays all zero (scale 0); several
weight-decay groups, listed out of order, leaving a range in no group, with
boundaries off the block grid; a changing learning rate; zero and random
starting state. Then the same under every ATen CPU capability this machine
has (a subprocess per capability, which builds the kernel for it), any thread
count, every kind of ``lowp_out``, and a NaN gradient (the documented rule:
its block's scales turn NaN in both paths, nothing else differs). That both
follow AdamW is tests/plugins/test_adamw_8bit.py's job; that the kernel's
encoder equals quant8's on every key, tests/plugins/test_adamw8_encoder.py's.

The kernel is built once (about 25 s on 2 cores, plus as long again for the
DEFAULT capability's build, the first time; later runs load them from the
torch extensions cache).

Run: ``pytest tests/plugins/test_adamw8_kernel.py``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit import Plugins
from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.adamw_8bit import KERNEL_SOURCE, AdamW8bit, slidekit_optimizers
from slidekit_optim.layer_adam import KernelUnavailable, kernel_status, load_kernel
from slidekit_optim.quant8 import BLOCK_SIZE, num_blocks

HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8)
LR = 1e-3


@pytest.fixture(scope="module")
def kernel():
    """The fused kernel, built (or loaded from cache) once; skipped only where no compiler/ninja exists."""
    status = kernel_status(KERNEL_SOURCE)
    if status.startswith(("pure torch (no C++ compiler", "pure torch (ninja")):
        pytest.skip(status)
    return load_kernel(KERNEL_SOURCE)


def _groups(n: int, kind: str) -> list[ParamGroupRange]:
    """Kind "mixed": three ranges with decays 0.1, 0.01 (listed out of order) and 0, and for n >= 10 a
    tail in no group. Kind "none": no groups at all, so nothing decays."""
    if kind == "none":
        return []
    if n < 4:
        return [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    a, b, c = int(n * 0.3), int(n * 0.55), n if n < 10 else int(n * 0.9)
    return [
        ParamGroupRange(start=0, stop=a, weight_decay=0.1),
        ParamGroupRange(start=b, stop=c, weight_decay=0.01),
        ParamGroupRange(start=a, stop=b, weight_decay=0.0),
    ]


def _inputs(n: int, steps: int, grad_dtype: torch.dtype, *, seed: int = 0):
    """(init, grads): magnitudes log-uniform over 1e-8..1e2, 5 % exact zeros, a few huge values, and
    (n > 2 blocks) block 1 zero at every step, so its moments and scales stay exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    scale = 10 ** torch.empty(n).uniform_(-8, 2, generator=gen)
    scale[torch.rand(n, generator=gen) < 0.05] = 0.0
    if n > 100:
        scale[torch.randperm(n, generator=gen)[:3]] = torch.tensor([1e6, 3e9, 1e15])
    if n > 2 * BLOCK_SIZE:
        scale[BLOCK_SIZE : 2 * BLOCK_SIZE] = 0.0
    grads = [(torch.randn(n, generator=gen) * scale).to(grad_dtype) for _ in range(steps)]
    return init, grads


def _random_state(opt: AdamW8bit, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Arbitrary codes, and scales over six decades with some exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, (dtype, numel) in opt.state_layout(n).items():
        if dtype == torch.uint8:
            state[name] = torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8)
        else:
            absmax = 10 ** torch.empty(numel).uniform_(-6, 0, generator=gen)
            state[name] = torch.where(torch.rand(numel, generator=gen) < 0.1, 0.0, absmax)
    return state


def _updates(impls, init, grads, groups, *, threads=None, random_state=False, lowp="bf16"):
    """One update per gradient by each of ``impls``, with a decaying learning rate.

    Returns {impl: {"master", "lowp" (when asked), and the four state tensors}}.
    """
    n = init.numel()
    hyper = OptimizerHyper(betas=HYPER.betas, eps=HYPER.eps, threads=threads)
    runs = {}
    for impl in impls:
        opt = AdamW8bit(hyper, impl=impl)
        assert opt.impl == impl
        if random_state:
            state = _random_state(opt, n, seed=n)
        else:
            state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
        out = {
            "bf16": lambda: torch.empty(n, dtype=torch.bfloat16),
            "fp32": lambda: torch.empty(n),  # another dtype: cast after the update
            "strided": lambda: torch.empty(2 * n, dtype=torch.bfloat16)[::2],  # not contiguous
            None: lambda: None,
        }[lowp]()
        runs[impl] = (opt, {"master": init.clone(), **state, "lowp": out})
    for t, g in enumerate(grads, 1):
        lr = LR * (1 - t / (2 * len(grads)))
        for opt, r in runs.values():
            state = {k: v for k, v in r.items() if k not in ("master", "lowp")}
            opt.step(r["master"], g, state, lr=lr, count=t, groups=groups, lowp_out=r["lowp"])
    return {impl: {k: v for k, v in r.items() if v is not None} for impl, (_, r) in runs.items()}


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same bits (so -0.0 differs from 0.0); otherwise say how many elements differ, where, and how."""
    views = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
    a, e = actual.contiguous(), expected.contiguous()
    assert a.dtype == e.dtype and a.shape == e.shape, (what, a.dtype, e.dtype, a.shape, e.shape)
    differ = (a.view(views[a.element_size()]) != e.view(views[e.element_size()])).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        raise AssertionError(
            f"{what}: {differ.numel()} of {a.numel()} elements differ, first at {i} "
            f"(block {i // BLOCK_SIZE}): {a[i].item()!r} vs {e[i].item()!r}"
        )


def _assert_runs_equal(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
    for key in expected:
        _assert_bitwise(actual[key], expected[key], f"{what}: {key}")


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", ["mixed", "none"])
@pytest.mark.parametrize("n", [1, 7, 255, 256, 257, 4099, 100_003])
def test_cpp_equals_torch_path_bitwise(kernel, one_torch_thread, n, groups, grad_dtype):
    steps = 30 if n < 100_000 else 12
    init, grads = _inputs(n, steps, grad_dtype)
    runs = _updates(("cpp", "torch"), init, grads, _groups(n, groups))
    _assert_runs_equal(runs["cpp"], runs["torch"], f"n={n}")
    cpp = runs["cpp"]
    _assert_bitwise(cpp["lowp"], cpp["master"].to(torch.bfloat16), "lowp vs master.to(bfloat16)")
    # The run must move the parameters and fill the state, or the comparison means little.
    assert (cpp["master"] - init).abs().max() > LR / 2 and (cpp["master"] != init).float().mean() > 0.5
    assert bool((cpp["exp_avg_absmax"] > 0).any()) and bool((cpp["exp_avg_sq_codes"] > 0).any())
    if n > 2 * BLOCK_SIZE:  # the block whose gradient is always zero keeps scale 0
        assert cpp["exp_avg_absmax"][1] == 0 and cpp["exp_avg_sq_absmax"][1] == 0


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [255, 4099])
def test_cpp_equals_torch_path_from_arbitrary_state(kernel, one_torch_thread, n, grad_dtype):
    """Every code of both maps decoded, under scales from 1e-6 to 1 and 0."""
    init, grads = _inputs(n, 5, grad_dtype, seed=1)
    runs = _updates(("cpp", "torch"), init, grads, _groups(n, "mixed"), random_state=True)
    _assert_runs_equal(runs["cpp"], runs["torch"], f"n={n}, random state")


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_ties_and_neighbours_of_every_boundary_encode_like_binary_search(kernel, impl):
    """With beta1 = 0 the new first moment is the gradient itself, so a gradient of b * A, with A the
    block's largest magnitude (a power of two), makes m / A exactly the map boundary b. Every boundary
    of the signed map, and the floats on either side of it, must take the code that a binary search
    over the boundaries (ties to the smaller code) gives."""
    opt = AdamW8bit(OptimizerHyper(betas=(0.0, 0.95)), impl=impl)
    b = opt.m_map.boundaries
    y = torch.cat(
        [b, torch.nextafter(b, torch.full_like(b, 2.0)), torch.nextafter(b, torch.full_like(b, -2.0))]
    )
    blocks = y.view(-1, BLOCK_SIZE - 1)  # 3 blocks of 255, then 1.0 sets each block's scale
    y = torch.cat([blocks, torch.ones(blocks.shape[0], 1)], dim=1).flatten()
    n, scale = y.numel(), 2.0**-3
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    opt.step(torch.zeros(n), y * scale, state, lr=LR, count=1, groups=[])
    assert bool((state["exp_avg_absmax"] == scale).all())
    _assert_bitwise(state["exp_avg_codes"], torch.bucketize(y, b).to(torch.uint8), f"{impl} codes at ties")


def _capabilities() -> list[str]:
    """The ATen CPU capabilities this machine can run: DEFAULT, and AVX2 / AVX512 where present."""
    have = str(torch.backends.cpu.get_cpu_capability()).lower()
    ladder = ["default", "avx2", "avx512"]
    return ladder[: ladder.index(have) + 1] if have in ladder else ["default", have]


@pytest.mark.parametrize("capability", _capabilities())
def test_bits_do_not_depend_on_the_aten_cpu_capability(kernel, tmp_path, capability):
    """Under each capability, the kernel (built for it: DEFAULT without vector ISA flags) and the torch
    path (on ATen's kernels for it) give what the kernel gives here. The inputs are made here and handed
    over: torch.randn itself differs between capabilities."""
    n, steps = 20_003, 8
    inputs = {dtype: _inputs(n, steps, getattr(torch, dtype)) for dtype in ("float32", "bfloat16")}
    torch.save(inputs, tmp_path / "inputs.pt")
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_adamw8_kernel as t; "
        "print(torch.backends.cpu.get_cpu_capability()); torch.set_num_threads(1); "
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        f"r = {{d: t._updates(('cpp', 'torch'), *x[d], t._groups({n}, 'mixed')) for d in x}}; "
        f"torch.save(r, {str(tmp_path / 'result.pt')!r})"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    # The timeout only turns a hang into a failure. The child may build the kernel for this capability
    # from cold (or wait for another process building it into the same cache): 513 s on the shared
    # 2-core machine at a load average of 6, where the former 600 s nearly ran out. An hour, then.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0].lower() == capability, done.stdout
    theirs = torch.load(tmp_path / "result.pt")
    for dtype, (init, grads) in inputs.items():
        ours = _updates(("cpp",), init, grads, _groups(n, "mixed"))["cpp"]
        for impl in ("cpp", "torch"):
            _assert_runs_equal(theirs[dtype][impl], ours, f"ATEN_CPU_CAPABILITY={capability} {impl} {dtype}")


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # The timeout only turns a hang into a failure: the child loads the kernel the parent built.
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=3600
    )


def test_gather_and_permute_decodes_give_the_same_bits(kernel, tmp_path):
    """The AVX-512 pass decodes the codes by gather or by permutes (SLIDEKIT_ADAMW8_DECODE, else the faster
    one timed on first use): each way, in a process of its own, from arbitrary codes (every one of the 256
    decoded), the steps equal the torch path's bit for bit; a value naming neither way is refused."""
    if kernel.vector_width() != 16:
        pytest.skip("built without AVX-512: the portable loops decode, there is no choice")
    assert kernel.decode_way() in ("gather", "permute")
    n, steps = 20_003, 4
    torch.save(_inputs(n, steps, torch.bfloat16, seed=3), tmp_path / "inputs.pt")
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_adamw8_kernel as t; torch.set_num_threads(1); "
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        f"r = t._updates(('cpp', 'torch'), *x, t._groups({n}, 'mixed'), random_state=True); "
        f"torch.save(r, {str(tmp_path / 'result.pt')!r}); print(t.load_kernel(t.KERNEL_SOURCE).decode_way())"
    )
    for way in ("gather", "permute"):
        done = _child(code, {"SLIDEKIT_ADAMW8_DECODE": way})
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-1] == way, done.stdout
        r = torch.load(tmp_path / "result.pt")
        _assert_runs_equal(r["cpp"], r["torch"], f"decode by {way}")
    done = _child(code, {"SLIDEKIT_ADAMW8_DECODE": "gathr"})
    assert done.returncode != 0
    refusal = "SLIDEKIT_ADAMW8_DECODE=gathr is not one of auto, gather, permute"
    assert refusal in done.stderr, done.stderr[-3000:]


def test_thread_count_changes_nothing(kernel):
    """Any number of tasks (OptimizerHyper.threads, torch's thread count) gives the same bits."""
    n = 1_000_003
    init, grads = _inputs(n, 3, torch.bfloat16)
    groups = _groups(n, "mixed")
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # three tasks even on fewer cores: the split is what is under test
    try:
        base = _updates(("cpp",), init, grads, groups)["cpp"]
        for threads in (1, 2, 5):  # 5 is more than torch's 3: capped, still the same bits
            other = _updates(("cpp",), init, grads, groups, threads=threads)["cpp"]
            _assert_runs_equal(other, base, f"threads={threads}")
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        _assert_runs_equal(_updates(("torch",), init, grads, groups)["torch"], base, "torch path")
    finally:
        torch.set_num_threads(before)


def test_kernel_reports_the_threads_it_used(kernel):
    n = 1_000_003  # 3907 blocks: 30 tasks' worth at 128 blocks per task at least
    opt = AdamW8bit(HYPER, impl="cpp")
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    master, grad = torch.randn(n), torch.randn(n).bfloat16()
    m, v = opt.m_map, opt.v_map

    def used(max_tasks: int, numel: int = n) -> int:
        return kernel.adamw8_step_(
            master[:numel],
            grad[:numel],
            state["exp_avg_codes"][:numel],
            state["exp_avg_absmax"][: num_blocks(numel)],
            state["exp_avg_sq_codes"][:numel],
            state["exp_avg_sq_absmax"][: num_blocks(numel)],
            None,
            *(m.values, m.packed, v.values, v.packed),
            [numel],
            [1.0],
            *(0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3),
            max_tasks,
        )

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert used(0) == 3
        assert used(1) == 1
        assert used(2) == 2
        assert used(8) == 3
        assert used(0, numel=200 * BLOCK_SIZE) == 1  # too small to split: one task
    finally:
        torch.set_num_threads(before)


def test_a_nan_gradient_spoils_its_block_alike_in_both_paths(kernel, one_torch_thread):
    """The documented NaN rule: a NaN makes its block's scales NaN, in both paths; everything that is
    not NaN (the other blocks, and in its block the first step's other elements) is bit for bit the
    same, and the NaN lands at the same places."""
    n = 4 * BLOCK_SIZE + 77
    init, grads = _inputs(n, 2, torch.bfloat16, seed=3)
    grads[0][BLOCK_SIZE + 5] = torch.nan  # block 1, first step
    runs = _updates(("cpp", "torch"), init, grads[:1], _groups(n, "mixed"))
    cpp, ref = runs["cpp"], runs["torch"]
    for key in ("master", "exp_avg_absmax", "exp_avg_sq_absmax"):
        nan = torch.isnan(ref[key])
        assert torch.equal(torch.isnan(cpp[key]), nan), key
        _assert_bitwise(cpp[key][~nan], ref[key][~nan], f"{key} outside the NaN")
    assert bool(torch.isnan(cpp["exp_avg_absmax"][1])) and int(torch.isnan(cpp["master"]).sum()) == 1
    for key in ("exp_avg_codes", "exp_avg_sq_codes"):
        keep = torch.ones(n, dtype=torch.bool)
        keep[BLOCK_SIZE + 5] = False  # the NaN's own code depends on its sign, which may differ
        _assert_bitwise(cpp[key][keep], ref[key][keep], key)
    later = _updates(("cpp", "torch"), init, grads, _groups(n, "mixed"))  # block 1 decodes to NaN
    spoiled = slice(BLOCK_SIZE, 2 * BLOCK_SIZE)
    for impl, run in later.items():
        assert bool(torch.isnan(run["master"][spoiled]).all()), impl
    rest = torch.ones(n, dtype=torch.bool)
    rest[spoiled] = False
    _assert_bitwise(later["cpp"]["master"][rest], later["torch"]["master"][rest], "master, other blocks")


@pytest.mark.parametrize("lowp", [None, "fp32", "strided"])
def test_every_kind_of_lowp_out(kernel, one_torch_thread, lowp):
    """No copy, a copy of another dtype, a strided BF16 view: all cast from the same master."""
    n = 3001
    init, grads = _inputs(n, 4, torch.bfloat16)
    groups = _groups(n, "mixed")
    ref = _updates(("torch",), init, grads, groups)["torch"]
    runs = _updates(("cpp", "torch"), init, grads, groups, lowp=lowp)
    for impl, run in runs.items():
        if lowp is None:
            assert "lowp" not in run
        else:
            out = run.pop("lowp")
            _assert_bitwise(out.contiguous(), run["master"].to(out.dtype), f"{impl} lowp={lowp}")
        _assert_runs_equal(run, {k: v for k, v in ref.items() if k != "lowp"}, f"{impl} lowp={lowp}")


# --------------------------------------------------------------------------- choosing the path


def test_impl_switch_and_the_registry_default(kernel):
    assert AdamW8bit(HYPER, impl="torch").impl == "torch"
    assert AdamW8bit(HYPER, impl="cpp").impl == "cpp"
    assert AdamW8bit(HYPER).impl == "cpp"  # auto, where the kernel builds
    reg = Plugins(entry_points=["adamw_8bit"]).get("optimizer", "adamw_8bit")
    assert reg.descriptor.factory(HYPER).impl == "cpp"  # what the engine and the benchmark get
    with pytest.raises(ValueError, match="auto, cpp, torch"):
        AdamW8bit(HYPER, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads"):
        AdamW8bit(OptimizerHyper(threads=0))


def test_availability_says_which_path_without_building(kernel):
    (descriptor,) = slidekit_optimizers()
    assert descriptor.available() == (True, "fused C++ kernel (loaded)")


def test_build_failure_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # keep the failure out of the cache
    broken = tmp_path / "broken_adamw8.cpp"
    broken.write_text('#error "deliberately broken kernel source"\n')
    with caplog.at_level(logging.WARNING, logger="slidekit_optim.adamw_8bit"):
        opt = AdamW8bit(HYPER, kernel_source=broken)
        assert opt.impl == "torch"
        assert AdamW8bit(HYPER, kernel_source=broken).impl == "torch"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "adamw_8bit runs on pure torch" in warnings[0], warnings
    assert "deliberately broken kernel source" in warnings[0]
    with pytest.raises(KernelUnavailable, match=r"adamw_8bit: impl='cpp'.*impl='auto'.*impl='torch'"):
        AdamW8bit(HYPER, impl="cpp", kernel_source=broken)


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_rejects_bad_groups_and_devices(kernel, impl):
    opt = AdamW8bit(HYPER, impl=impl)
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(8).items()}
    overlap = [
        ParamGroupRange(start=0, stop=6, weight_decay=0.1),
        ParamGroupRange(start=5, stop=8, weight_decay=0.0),
    ]
    for groups, match in (
        (overlap, "overlap"),
        ([ParamGroupRange(start=0, stop=9, weight_decay=0.1)], "outside"),
    ):
        with pytest.raises(ValueError, match=match):
            opt.step(torch.zeros(8), torch.zeros(8), state, lr=LR, count=1, groups=groups)
    with pytest.raises(ValueError, match=r"CPU or a CUDA/ROCm GPU, got master on meta"):
        opt.step(torch.zeros(8, device="meta"), torch.zeros(8), state, lr=LR, count=1, groups=[])


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_empty_unit_is_a_no_op(kernel, impl):
    opt = AdamW8bit(HYPER, impl=impl)
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(0).items()}
    opt.step(
        torch.zeros(0), torch.zeros(0), state, lr=LR, count=1, groups=[], lowp_out=torch.zeros(0).bfloat16()
    )
