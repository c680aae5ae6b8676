"""adamw_8bit's fused Triton update (adamw8_triton.py): bitwise the C++ kernel and the torch path.

One file, two modes, as tests/plugins/test_adam_triton.py:

* On a GPU the kernel is compiled: units are updated on the GPU through
  ``AdamW8bit.step`` and on the CPU by the fused C++ kernel and the torch
  path, and master, BF16 copy, both moments' codes and block scales must be
  bitwise equal; the torch path on the GPU too; and the engine trains a model
  with every unit kept on the GPU.
* Without a GPU, ``test_interpreted_run`` runs this file again in a subprocess
  with ``TRITON_INTERPRET=1``. There ``AdamW8bit`` sends CPU tensors down its
  GPU path (the ``_device_path_on_cpu`` switch, in the ``_OnDevicePath``
  subclass below), so the Triton kernel runs on CPU tensors in NumPy behind
  the very dispatch a GPU unit takes, and every output must be bitwise equal,
  the BF16 copy included: the kernel rounds it to BF16 in integers (as the C++
  kernel does), not by the float cast that the interpreter truncates, so no
  ulp of slack is needed. An engine run with every unit kept "on the device"
  updates each unit through the kernel and must give the bits of the run
  that updates every unit on the host with the C++ kernel.

The inputs are test_adamw8_kernel.py's (gradients over 1e-8..1e15 with exact
zeros and an all-zero block, decay groups off the block grid and out of
order, a decaying learning rate, zero or arbitrary starting state), so every
code of both maps is decoded and the tail block is short in every size but 256.

Run: ``pytest tests/plugins/test_adamw8_triton.py`` (about a minute interpreted on 2 cores).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from interpreted import HAVE_TRITON, INTERPRETED, ON_GPU, rerun_interpreted
from test_adamw8_kernel import (
    HYPER,
    LR,
    _assert_bitwise,
    _assert_runs_equal,
    _groups,
    _inputs,
    _random_state,
    _updates,
)

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, OptimizerHyper, ParamGroupRange
from slidekit.planning import Placement, Planner, Workload
from slidekit.plugins import Plugins
from slidekit.testing.models import random_batches, tiny_config
from slidekit_optim.adamw_8bit import KERNEL_SOURCE, AdamW8bit
from slidekit_optim.kernel_build import KernelUnavailable, load_kernel
from slidekit_optim.quant8 import BLOCK_SIZE

DEVICE = "cuda" if ON_GPU else "cpu"

needs_kernel = pytest.mark.skipif(
    not HAVE_TRITON or not (INTERPRETED or ON_GPU),
    reason="no GPU: test_interpreted_run runs these under the Triton interpreter",
)
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

#: Below one block, one short of it, one past it, and (on a GPU) many programs.
SIZES = (1, 255, 257, 4099) if INTERPRETED else (1, 255, 256, 257, 4099, 100_003, 3_000_001)
STEPS = 3 if INTERPRETED else 5


class _OnDevicePath(AdamW8bit):
    """adamw_8bit whose CPU tensors take the GPU path: the Triton kernel, run by the interpreter."""

    _device_path_on_cpu = True


def _device_optimizer(hyper: OptimizerHyper = HYPER) -> AdamW8bit:
    """What updates a unit kept on the device: adamw_8bit on a GPU, ``_OnDevicePath`` interpreted."""
    return AdamW8bit(hyper) if ON_GPU else _OnDevicePath(hyper)


@pytest.fixture(scope="module")
def cpu_impls() -> tuple[str, ...]:
    """The CPU paths to compare with: the C++ kernel (where it builds) and the torch path."""
    try:
        load_kernel(KERNEL_SOURCE)
    except KernelUnavailable:
        return ("torch",)
    return ("cpp", "torch")


def _device_run(
    opt: AdamW8bit,
    init: torch.Tensor,
    grads: list[torch.Tensor],
    groups: list[ParamGroupRange],
    *,
    random_state: bool = False,
    lowp: str | None = "bf16",
) -> dict[str, torch.Tensor]:
    """``_updates`` (same starting state, same learning rates) with ``opt`` on ``DEVICE``; results on the CPU."""
    n = init.numel()
    if random_state:
        state = {k: v.to(DEVICE) for k, v in _random_state(opt, n, seed=n).items()}
    else:
        state = {k: torch.zeros(c, dtype=dt, device=DEVICE) for k, (dt, c) in opt.state_layout(n).items()}
    out = {
        "bf16": lambda: torch.empty(n, dtype=torch.bfloat16, device=DEVICE),
        "fp32": lambda: torch.empty(n, device=DEVICE),
        "strided": lambda: torch.empty(2 * n, dtype=torch.bfloat16, device=DEVICE)[::2],
        None: lambda: None,
    }[lowp]()
    master = init.clone().to(DEVICE)
    for t, g in enumerate(grads, 1):
        lr = LR * (1 - t / (2 * len(grads)))
        opt.step(master, g.to(DEVICE), state, lr=lr, count=t, groups=groups, lowp_out=out)
    run = {"master": master, **state} | ({} if out is None else {"lowp": out})
    return {k: v.cpu() for k, v in run.items()}


def _compare(
    impls: tuple[str, ...],
    init: torch.Tensor,
    grads: list[torch.Tensor],
    groups: list[ParamGroupRange],
    *,
    random_state: bool = False,
    lowp: str | None = "bf16",
) -> dict[str, torch.Tensor]:
    """The device path against each CPU path, every output bitwise; returns the device run."""
    actual = _device_run(_device_optimizer(), init, grads, groups, random_state=random_state, lowp=lowp)
    expected = _updates(impls, init, grads, groups, random_state=random_state, lowp=lowp)
    for impl, run in expected.items():
        _assert_runs_equal(actual, run, f"{DEVICE} Triton vs CPU {impl}, n={init.numel()}")
    return actual


# --------------------------------------------------------------------------- the kernel against the CPU


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", ["mixed", "none"])
@pytest.mark.parametrize("n", SIZES)
def test_equals_the_cpu_kernel_and_torch_path_from_zero_state(
    cpu_impls, one_torch_thread, n, groups, grad_dtype
):
    """The first step from the all-zero state the engine hands over, then more steps, decay groups or none."""
    init, grads = _inputs(n, STEPS, grad_dtype)
    run = _compare(cpu_impls, init, grads, _groups(n, groups))
    if n > BLOCK_SIZE:  # the run moved the parameters and filled the state, so the comparison means something
        assert (run["master"] != init).float().mean() > 0.5
        assert bool((run["exp_avg_absmax"] > 0).any()) and bool((run["exp_avg_sq_codes"] > 0).any())
    if n > 2 * BLOCK_SIZE:  # the block whose gradient is always zero keeps scale 0
        assert run["exp_avg_absmax"][1] == 0 and run["exp_avg_sq_absmax"][1] == 0


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [255, 4099])
def test_equals_the_cpu_kernel_and_torch_path_from_arbitrary_state(
    cpu_impls, one_torch_thread, n, grad_dtype
):
    """Every code of both maps decoded, under scales from 1e-6 to 1 and 0."""
    init, grads = _inputs(n, STEPS, grad_dtype, seed=1)
    _compare(cpu_impls, init, grads, _groups(n, "mixed"), random_state=True)


@needs_kernel
def test_many_decay_ranges_inside_each_block(cpu_impls, one_torch_thread):
    """Ranges of 1 to 40 elements with four decays (and gaps in no group): most blocks straddle several, and
    the unit has more ranges than any other test (the kernel's table is padded to a power of two)."""
    n = 1111
    gen = torch.Generator().manual_seed(5)
    groups, pos, k = [], 0, 0
    while pos < n:
        stop = min(n, pos + int(torch.randint(1, 41, (1,), generator=gen)))
        if k % 7 != 3:  # every seventh range belongs to no group
            groups.append(ParamGroupRange(start=pos, stop=stop, weight_decay=(0.1, 0.0, 0.01, 0.3)[k % 4]))
        pos, k = stop, k + 1
    assert len(groups) > 40
    init, grads = _inputs(n, STEPS, torch.bfloat16, seed=2)
    _compare(cpu_impls, init, grads, groups[::-1], random_state=True)  # listed out of order


@needs_kernel
@pytest.mark.parametrize("lowp", [None, "fp32", "strided"])
def test_every_kind_of_lowp_out(cpu_impls, one_torch_thread, lowp):
    """No copy, a copy of another dtype, a strided BF16 view: all cast from the same master."""
    n = 3001
    init, grads = _inputs(n, 2, torch.bfloat16)
    run = _compare(cpu_impls, init, grads, _groups(n, "mixed"), lowp=lowp)
    if lowp is None:
        assert "lowp" not in run
    else:
        _assert_bitwise(run["lowp"].contiguous(), run["master"].to(run["lowp"].dtype), f"lowp={lowp}")


@needs_kernel
def test_ties_and_neighbours_of_every_boundary_encode_like_binary_search():
    """test_adamw8_kernel's test of the encoder, on the device path: with beta1 = 0 the first moment is the
    gradient, so each boundary of the signed map and the floats either side of it land exactly on m / A."""
    opt = _device_optimizer(OptimizerHyper(betas=(0.0, 0.95)))
    b = opt.m_map.boundaries
    y = torch.cat(
        [b, torch.nextafter(b, torch.full_like(b, 2.0)), torch.nextafter(b, torch.full_like(b, -2.0))]
    )
    blocks = y.view(-1, BLOCK_SIZE - 1)  # 3 blocks of 255, then 1.0 sets each block's scale
    y = torch.cat([blocks, torch.ones(blocks.shape[0], 1)], dim=1).flatten()
    n, scale = y.numel(), 2.0**-3
    state = {k: torch.zeros(c, dtype=dt, device=DEVICE) for k, (dt, c) in opt.state_layout(n).items()}
    opt.step(torch.zeros(n, device=DEVICE), (y * scale).to(DEVICE), state, lr=LR, count=1, groups=[])
    assert bool((state["exp_avg_absmax"] == scale).all())
    codes = state["exp_avg_codes"].cpu()
    _assert_bitwise(codes, torch.bucketize(y, b).to(torch.uint8), "codes at ties")


@needs_kernel
def test_empty_unit_is_a_no_op():
    opt = _device_optimizer()
    state = {k: torch.zeros(c, dtype=dt, device=DEVICE) for k, (dt, c) in opt.state_layout(0).items()}
    low = torch.zeros(0, dtype=torch.bfloat16, device=DEVICE)
    opt.step(
        torch.zeros(0, device=DEVICE),
        torch.zeros(0, device=DEVICE),
        state,
        lr=LR,
        count=1,
        groups=[],
        lowp_out=low,
    )


# --------------------------------------------------------------------------- GPU only


@needs_gpu
def test_torch_impl_keeps_the_torch_path_on_the_gpu_with_the_same_bits():
    n = 100_003
    init, grads = _inputs(n, 3, torch.bfloat16, seed=1)
    groups = _groups(n, "mixed")
    fused = _device_run(AdamW8bit(HYPER), init, grads, groups, random_state=True)
    plain = _device_run(AdamW8bit(HYPER, impl="torch"), init, grads, groups, random_state=True)
    _assert_runs_equal(fused, plain, "cuda Triton vs cuda torch path")


@needs_gpu
def test_a_new_map_reaches_the_gpu():
    """``m_map``/``v_map`` are read at every step on the GPU too: replacing one is not hidden by the copy
    of the old one kept on the device."""
    from slidekit_optim.quant8 import dynamic_map

    n = 5000
    init, grads = _inputs(n, 3, torch.bfloat16, seed=4)
    groups = _groups(n, "mixed")
    gpu, cpu = AdamW8bit(HYPER), AdamW8bit(HYPER, impl="torch")
    _device_run(gpu, init, grads[:1], groups)  # the default maps go to the GPU
    for opt in (gpu, cpu):
        opt.v_map = dynamic_map(signed=False)  # without keep_nonzero: tiny second moments round to 0
    actual = _device_run(gpu, init, grads, groups)
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in cpu.state_layout(n).items()}
    master, low = init.clone(), torch.empty(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, 1):
        cpu.step(master, g, state, lr=LR * (1 - t / (2 * len(grads))), count=t, groups=groups, lowp_out=low)
    _assert_runs_equal(actual, {"master": master, **state, "lowp": low}, "after replacing v_map")


@needs_gpu
def test_engine_keeps_every_unit_on_the_gpu_with_adamw_8bit(tiny_model):
    """Refused before adamw_8bit declared device_update ("updates on the CPU only"); now every unit is kept
    on the GPU, updated there, and the run follows the one that slides every unit through the CPU."""
    model = ModelConfig(source=str(tiny_model("llama")))
    batches = random_batches(128, steps=6, batch=4, seq_len=32)

    def run(resident: str) -> tuple[list[float], int, int]:
        cfg = TrainConfig(
            model=model,
            optim=OptimConfig(name="adamw_8bit", lr=1e-4, weight_decay=0.1, max_grad_norm=1.0),
            engine=EngineConfig(device="cuda", compute_dtype="bfloat16", gpu_resident=resident),
            steps=6,
        )
        with Trainer(cfg) as t:
            losses = t.fit(batches).losses
            return losses, len(t.engine.window.resident), len(t.spec.units)

    host_losses, none_kept, _ = run("none")
    losses, kept, units = run("all")
    assert none_kept == 0 and kept == units
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(host_losses), rtol=1e-3, atol=0)


# --------------------------------------------------------------------------- the engine, on the CPU


class _DevicePathPlugin:
    @hookimpl
    def slidekit_optimizers(self) -> Iterator[OptimizerDescriptor]:
        yield OptimizerDescriptor(name="adamw_8bit_device_path", factory=_OnDevicePath)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreted run (test_interpreted_run) runs it")
def test_engine_all_resident_through_the_kernel_gives_the_bits_of_the_host_run(tiny_model):
    """Every unit kept "on the device" (the CPU here) and updated on the main thread through the Triton
    kernel, against every unit sliding and updated on the optimizer thread by the C++ kernel (or the torch
    path): same losses, masters and optimizer state, with exact global-norm clipping (the engine scales the
    gradients before the update), accumulation and decay groups that split blocks (norm weights, biases)."""
    model = ModelConfig(source=str(tiny_model("llama", num_hidden_layers=1, intermediate_size=64)))
    batches = random_batches(128, steps=6)  # 3 steps of 2 micro-batches

    def run(optimizer: str, resident: str):
        cfg = TrainConfig(
            model=model,
            optim=OptimConfig(name=optimizer, lr=1e-3, weight_decay=0.1, max_grad_norm=0.05),
            engine=EngineConfig(device="cpu", compute_dtype="float32", gpu_resident=resident),
            grad_accum=2,
            steps=3,
        )
        with Trainer(cfg, plugins=Plugins(extra=[("device-path", _DevicePathPlugin())])) as t:
            result = t.fit(batches)
            assert t.planner is not None and t.planner.device_updates  # adamw_8bit may keep units on a GPU
            kept = len(t.engine.window.resident)
            state = {
                f"{u}/{k}": v.clone()
                for u in range(len(t.spec.units))
                for k, v in t.engine.host.state.mapped(u).items()
            }
            return result, t.state_dict(), state, kept, len(t.spec.units)

    base, base_masters, base_state, _, _ = run("adamw_8bit", "none")
    result, masters, state, kept, units = run("adamw_8bit_device_path", "all")
    assert kept == units
    assert min(base.grad_norms) > 0.05  # clipping was on at every step
    assert result.losses == base.losses
    for name, value in base_masters.items():
        _assert_bitwise(masters[name], value, name)
    assert state.keys() == base_state.keys()
    for name, value in base_state.items():
        _assert_bitwise(state[name], value, name)


# --------------------------------------------------------------------------- CPU, no kernel needed


def test_rejects_tensors_on_another_device():
    opt = AdamW8bit(HYPER, impl="torch")
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(8).items()}
    with pytest.raises(
        ValueError, match=r"every tensor must be on the master's device cpu, got grad on meta"
    ):
        opt.step(torch.zeros(8), torch.zeros(8, device="meta"), state, lr=LR, count=1, groups=[])


def test_a_resident_unit_costs_about_10_bytes_per_parameter_in_bf16():
    """The figure adamw_8bit's docstring gives (16 with layer_adam), as the planner reserves it for a unit
    kept on the GPU: FP32 master, 8-bit state with its scales, BF16 weights and gradients."""
    spec = Plugins().adapter_for("llama").descriptor.factory(tiny_config("llama", hidden_size=512))
    opt = AdamW8bit(HYPER, impl="torch")
    planner = Planner(
        spec,
        Workload(batch_size=1, seq_len=16, grad_accum=1),
        compute_itemsize=2,
        state_bytes=lambda n: sum(c * dt.itemsize for dt, c in opt.state_layout(n).values()),
        media={"ram": "host", "gpu": "device"},
        device_type="cuda",
        device_updates=opt.device_update,
    )
    for unit, u in enumerate(spec.units):
        assert planner.resident_cost(unit) / u.numel == pytest.approx(10.03, abs=0.01)
    assert planner.residency(Placement(gpu_resident="all"), _cuda_machine()) == [True] * len(spec.units)


def _cuda_machine():
    from slidekit.planning import GIB, Machine

    return Machine(
        device_type="cuda",
        device_free=80 * GIB,
        device_total=80 * GIB,
        host_available=64 * GIB,
        host_total=64 * GIB,
        disk_free=None,
    )


# --------------------------------------------------------------------------- the interpreted run


@pytest.mark.skipif(INTERPRETED or ON_GPU or not HAVE_TRITON, reason="the outer CPU run starts it")
def test_interpreted_run():
    proc = rerun_interpreted(__file__)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout
