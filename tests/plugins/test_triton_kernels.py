"""The triton_cuda and triton_rocm kernel sets: conformance against torch_ref, convergence, availability.

One file, two modes:

* On a GPU the kernels are compiled: the conformance suite
  (``slidekit.testing.kernels``) runs both launch tables, NVIDIA's and AMD's
  (on an NVIDIA GPU the AMD table is just other block sizes), in float32 and
  bfloat16, and a tiny model trains 100 BF16 steps with each set and with torch_ref.
  RMSNorm and RoPE also run with every tiling ``benchmarks/kernels.py --tune``
  may pick (multi-row tiles over row counts they do not divide, dW partial
  grids from one program to more programs than tiles), and with strided inputs.
* Without a GPU, ``test_interpreted_run`` runs this file again in a subprocess
  with ``TRITON_INTERPRET=1`` (set there before triton is imported, so it never
  leaks into other tests), where the same tests run on CPU tensors in float32
  (the interpreter truncates float32 -> bfloat16 casts, so only float32 means
  anything there).

Run: ``pytest tests/plugins/test_triton_kernels.py``: about a minute on 2 CPU cores
(interpreted); on a GPU machine the same command runs the compiled kernels, most of
its time going to Triton compiling each block-size variant once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from interpreted import HAVE_TRITON, INTERPRETED, ON_GPU, rerun_interpreted

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.errors import DriverUnavailableError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSet, KernelSetDescriptor
from slidekit.testing.kernels import (
    TOLERANCES,
    assert_close,
    check_rms_norm,
    check_rope,
    conformance_cases,
    reference_kernels,
)
from slidekit_kernels import triton_cuda, triton_rocm
from slidekit_kernels.triton_common.vendors import (
    AMD,
    LAUNCH_CONFIGS,
    NVIDIA,
    TUNE_SPACE,
    LaunchConfig,
    availability,
    tune_configs,
)

DEVICE = "cpu" if INTERPRETED else ("cuda" if ON_GPU else None)
DTYPES = (torch.float32, torch.bfloat16) if ON_GPU else (torch.float32,)
SETS = {"triton_cuda": NVIDIA, "triton_rocm": AMD}

needs_kernels = pytest.mark.skipif(
    DEVICE is None or not HAVE_TRITON,
    reason="no GPU (or no triton): test_interpreted_run runs these under the Triton interpreter",
)
outer_run = pytest.mark.skipif(INTERPRETED, reason="needs no kernels: the outer run covers it")


def _build(name: str) -> KernelSet:
    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet  # imports triton

    return TritonKernelSet(name, SETS[name])


# --------------------------------------------------------------------------- conformance


@needs_kernels
@pytest.mark.parametrize("case", conformance_cases(DTYPES), ids=str)
@pytest.mark.parametrize("name", list(SETS))
def test_conformance(name, case):
    case.check(_build(name), DEVICE)


# --------------------------------------------------------------------------- convergence

STEPS = 100
VOCAB = 128


def _recurrence_batches(steps: int, batch: int = 2, seq_len: int = 16) -> list[Batch]:
    """Rows of x_{i+1} = (5 x_i + 3) mod V from random starts: learnable, so the loss falls far."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq_len + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for i in range(seq_len):
            ids[:, i + 1] = (5 * ids[:, i] + 3) % VOCAB
        labels = ids[:, 1:].clone()
        labels[0, :2] = -100
        out.append(Batch(ids[:, :-1].contiguous(), labels))
    return out


class _KernelsUnderTest:
    """Offers a ready kernel set under a test name, for the device the test runs on."""

    def __init__(self, name: str, kernels: KernelSet, device_type: str) -> None:
        self.name, self.kernels, self.device_type = name, kernels, device_type

    @hookimpl
    def slidekit_kernel_sets(self):
        yield KernelSetDescriptor(
            name=self.name, factory=lambda: self.kernels, devices=(self.device_type,), priority=-1
        )


def _train(model_dir: Path, kernels: str, plugins: Plugins, batches: list[Batch]) -> list[float]:
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=3e-3),
        engine=EngineConfig(
            device=DEVICE, compute_dtype="bfloat16" if ON_GPU else "float32", kernels=kernels
        ),
        steps=len(batches),
    )
    with Trainer(cfg, plugins=plugins) as trainer:
        assert trainer.selections["kernels"].name == kernels
        return trainer.fit(batches).losses


@pytest.fixture(scope="module")
def reference_losses(tiny_model):
    model_dir = tiny_model("llama", num_hidden_layers=1)
    return model_dir, _train(model_dir, "torch_ref", Plugins(), _recurrence_batches(STEPS))


@needs_kernels
@pytest.mark.parametrize("name", list(SETS))
def test_convergence_matches_torch_ref(name, reference_losses):
    model_dir, ref = reference_losses
    plugins = Plugins()
    family = "cuda" if DEVICE == "cuda" and not torch.version.hip else ("rocm" if DEVICE == "cuda" else "cpu")
    try:  # the set's own registry entry where it serves this machine (a GPU of its vendor)
        plugins.select("kernels", name, family)
        selected = name
    except DriverUnavailableError:  # elsewhere the kernels themselves, under a test name
        selected = f"{name}_under_test"
        plugins = Plugins(extra=[("under_test", _KernelsUnderTest(selected, _build(name), family))])
    losses = _train(model_dir, selected, plugins, _recurrence_batches(STEPS))

    assert ref[-1] < 0.3 * ref[0], f"the reference did not learn: {ref[0]:.3f} -> {ref[-1]:.3f}"
    if ON_GPU:  # BF16: rounding differs step by step and the runs drift apart, so compare where they end
        tail, ref_tail = sum(losses[-10:]) / 10, sum(ref[-10:]) / 10
        assert abs(losses[0] - ref[0]) <= 1e-2 * ref[0], (losses[0], ref[0])
        assert abs(tail - ref_tail) <= 0.03 + 0.1 * ref_tail, f"last 10 steps: {tail:.4f} vs {ref_tail:.4f}"
    else:  # FP32: the same computation up to summation order, step for step
        worst = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
        assert worst <= 1e-3, f"losses differ by up to {worst:.2e} relative; first {losses[:3]} vs {ref[:3]}"


# --------------------------------------------------------------------------- the interpreter run


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
@pytest.mark.skipif(ON_GPU, reason="compiled on this GPU instead")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_interpreted_run():
    """This file again, in a subprocess with TRITON_INTERPRET=1: every kernel test on CPU tensors."""
    # One intra-op thread: the tensors are tiny, and on a busy machine OpenMP threads waiting for
    # each other in every op cost several times the work itself.
    proc = rerun_interpreted(__file__, OMP_NUM_THREADS="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    expected = len(SETS) * (len(conformance_cases()) + 1)  # conformance and convergence per set
    assert passed and int(passed.group(1)) >= expected, out[-3000:]


# --------------------------------------------------------------------------- registry and availability


@outer_run
def test_both_sets_are_registered_with_priority_over_torch_ref():
    plugins = Plugins()
    for name, devices in (("triton_cuda", ("cuda",)), ("triton_rocm", ("rocm",))):
        reg = plugins.get("kernels", name)
        assert reg.plugin == name
        assert reg.descriptor.devices == devices
        assert reg.descriptor.priority > plugins.get("kernels", "torch_ref").descriptor.priority


@pytest.mark.skipif(not ON_GPU or bool(torch.version.hip) or not HAVE_TRITON, reason="needs an NVIDIA GPU")
def test_auto_selects_triton_cuda_on_an_nvidia_gpu():
    selection = Plugins().select("kernels", "auto", "cuda")
    assert selection.name == "triton_cuda", selection.reason


@outer_run
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_unavailable_on_a_cpu_machine_with_the_reason():
    plugins = Plugins()
    ok, why = plugins.availability("kernels", "triton_cuda")
    assert not ok and ("no CUDA device" in why or "triton is not installed" in why)
    ok, why = plugins.availability("kernels", "triton_rocm")
    assert not ok and ("ROCm" in why or "triton is not installed" in why)
    assert plugins.select("kernels", "auto", "cpu").name == "torch_ref"


@outer_run
def test_vendor_probes(monkeypatch):
    """CUDA build: only triton_cuda; HIP build: only triton_rocm; no device: neither; reasons say so."""
    if not HAVE_TRITON:
        pytest.skip("needs triton installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_cuda.available()[0]
    ok, why = triton_rocm.available()
    assert not ok and "not a ROCm (HIP) build" in why and "triton_cuda" in why
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert triton_rocm.available()[0]
    ok, why = triton_cuda.available()
    assert not ok and "ROCm (HIP 6.2.41133) build" in why and "triton_rocm" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not triton_rocm.available()[0] and "no ROCm device" in triton_rocm.available()[1]
    with pytest.raises(ValueError, match="choose one of: cuda, rocm"):
        availability("metal")


@outer_run
def test_without_triton_the_sets_say_so_and_slidekit_plugins_still_works():
    """With triton unimportable, listing plugins works and both sets report why they are unavailable."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from slidekit.cli import main\n"
        "raise SystemExit(main(['plugins']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("kernels")]
    for name in ("triton_cuda", "triton_rocm"):
        (row,) = [r for r in rows if f" {name} " in r]
        assert "unavailable" in row and "triton is not installed" in row


@outer_run
def test_launch_tables():
    assert LAUNCH_CONFIGS == {"cuda": NVIDIA, "rocm": AMD}
    assert (NVIDIA.warp_size, AMD.warp_size) == (32, 64)
    for cfg in (NVIDIA, AMD):
        assert cfg.warp_size * cfg.max_warps == 1024
        for elements in (1, 100, 4096, 1 << 20):
            for per_thread in (None, 1, 4, 64):
                warps = cfg.num_warps(elements, per_thread)
                assert 1 <= warps <= cfg.max_warps and warps & (warps - 1) == 0
        assert cfg.rows_per_tile(cfg.rms_fwd_tile, 1 << 16) == 1 and cfg.rows_per_tile(4096, 64) == 64
    with pytest.raises(ValueError, match="rms_bwd_tile must be a power of two"):
        replace(NVIDIA, rms_bwd_tile=3000)
    with pytest.raises(ValueError, match="rms_bwd_programs_per_sm must be a positive integer"):
        replace(NVIDIA, rms_bwd_programs_per_sm=0)


@outer_run
def test_tune_space_configs_are_valid_and_vary_one_group_at_a_time():
    fields = set(LaunchConfig.__dataclass_fields__)
    seen: dict[str, int] = {}
    for cfg in (NVIDIA, AMD):
        for group, tuned in tune_configs(cfg):
            assert set(TUNE_SPACE[group]) <= fields
            changed = {f for f in fields if getattr(tuned, f) != getattr(cfg, f)}
            assert changed <= set(TUNE_SPACE[group]), (group, changed)
            seen[group] = seen.get(group, 0) + 1
    for group, values in TUNE_SPACE.items():
        n = 1
        for v in values.values():
            n *= len(v)
        assert seen[group] == 2 * n


@outer_run
@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton installed")
@pytest.mark.parametrize("programs_per_sm", [1, 2, 3, 16])
@pytest.mark.parametrize("tile", [1, 2, 4096])
def test_rms_norm_backward_plan_covers_every_row_once(programs_per_sm, tile):
    """Persistent programs own contiguous ranges of tiles: every tile once, no program without rows."""
    from slidekit_kernels.triton_common.rms_norm import backward_plan

    for h in (8, 123, 4096):
        for n_rows in (1, 2, 7, 37, 210, 8192, 8193):
            cfg = replace(NVIDIA, rms_bwd_tile=tile * 4096, rms_bwd_programs_per_sm=programs_per_sm)
            plan = backward_plan(n_rows, h, cfg, sms=3)
            tiles = -(-n_rows // plan.rows)
            assert plan.rows == max(1, tile * 4096 // plan.block_n) and plan.block_n >= h
            assert 1 <= plan.programs <= min(tiles, 3 * programs_per_sm)  # dW partials: never more than tiles
            assert (plan.programs - 1) * plan.steps < tiles <= plan.programs * plan.steps


_TILING = ("rms_fwd_tile", "rms_bwd_tile", "rms_bwd_programs_per_sm", "rope_tile")


def _tilings(*groups: str) -> list[LaunchConfig]:
    """The distinct tilings the tune space gives ``groups`` (warp counts: test_triton_compile and --tune)."""
    out: dict[tuple[int, ...], LaunchConfig] = {}
    for group, cfg in tune_configs(NVIDIA):
        if group in groups:
            out.setdefault(tuple(getattr(cfg, f) for f in _TILING), cfg)
    return list(out.values())


def _tiling_id(cfg: LaunchConfig) -> str:
    return "-".join(f"{f}={getattr(cfg, f)}" for f in _TILING)


def _tuned_set(cfg: LaunchConfig) -> KernelSet:
    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet

    return TritonKernelSet("triton_cuda_tuned", cfg)


@needs_kernels
@pytest.mark.parametrize("cfg", _tilings("rms_norm backward", "rms_norm forward"), ids=_tiling_id)
def test_rms_norm_every_tuned_tiling(cfg):
    """Tiles of 32 or 64 rows over 210 rows (partial last tile), 1-3 programs per SM; H = 4096 too."""
    ks = _tuned_set(cfg)
    for shape in ((3, 70, 123), (9, 4096)):
        for dtype in DTYPES:
            check_rms_norm(ks, shape, dtype=dtype, device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("cfg", _tilings("rope"), ids=_tiling_id)
def test_rope_every_tuned_tiling(cfg):
    """Several positions per program over position counts they do not divide; odd head counts."""
    ks = _tuned_set(cfg)
    for shape in ((2, 3, 3, 17, 80), (1, 8, 2, 33, 128)):
        for layout in ("bhtd", "bthd"):
            for dtype in DTYPES:
                check_rope(ks, shape, dtype=dtype, device=DEVICE, layout=layout)


@needs_kernels
@pytest.mark.parametrize("layout", ["rows_apart", "transposed"])
def test_rms_norm_strided_input_and_gradient(layout):
    """x with rows further apart than H (a slice) or with no unit stride (a copy), and a strided dy."""
    ks, ref = _build("triton_cuda"), reference_kernels()
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 96, generator=gen)
    x = base[..., :80] if layout == "rows_apart" else base[..., :80].transpose(0, 1)
    w = torch.randn(80, generator=gen) * 0.2 + 1.0
    dy = torch.randn(80, *x.shape[:-1], generator=gen).movedim(0, -1)  # last stride is not 1
    results = []
    for kernels in (ks, ref):
        xl = x.to(DEVICE).requires_grad_()
        wl = w.to(DEVICE).requires_grad_()
        y = kernels.rms_norm(xl, wl, 1e-6)
        results.append((y, *torch.autograd.grad(y, [xl, wl], dy.to(DEVICE))))
    tol = TOLERANCES[torch.float32]
    for name, a, e in zip(("y", "dx", "dw"), *results, strict=True):
        assert_close(a, e, tol["rms_norm.grad" if name != "y" else "rms_norm"], f"{layout} {name}")
        assert a.shape == e.shape


@needs_kernels
def test_launchers_make_no_copies_of_dense_inputs():
    """Contiguous x is read in place and y, dx come out in x's shape; RoPE outputs keep a transposed layout."""
    from slidekit_kernels.triton_common.rms_norm import rms_norm_backward, rms_norm_forward
    from slidekit_kernels.triton_common.rope import rope_apply

    x, w = torch.randn(2, 3, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    y, x2, rstd = rms_norm_forward(x, w, 1e-6, NVIDIA)
    assert x2 is x and y.shape == x.shape and y.is_contiguous() and rstd.shape == (6,)
    dx, dw = rms_norm_backward(torch.randn_like(y), x2, w, rstd, NVIDIA)
    assert dx.shape == x.shape and dw is not None and dw.shape == (64,)
    assert rms_norm_backward(torch.randn_like(y), x2, w, rstd, NVIDIA, want_dw=False)[1] is None
    q = torch.randn(2, 9, 4, 16, device=DEVICE).transpose(1, 2)  # (B, heads, T, D) view of (B, T, heads, D)
    k = torch.randn(2, 9, 2, 16, device=DEVICE).transpose(1, 2)
    cos, sin = torch.randn(9, 16, device=DEVICE), torch.randn(9, 16, device=DEVICE)
    qo, ko = rope_apply(q, k, cos, sin, NVIDIA)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()


@pytest.mark.skipif(INTERPRETED or not HAVE_TRITON, reason="checks the compiled kernels' device check")
def test_compiled_kernels_refuse_cpu_tensors_with_the_fix():
    ks = _build("triton_cuda")
    with pytest.raises(RuntimeError, match="use the torch_ref kernel set on the CPU"):
        ks.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


@needs_kernels
def test_bad_arguments_name_the_problem():
    ks = _build("triton_cuda")
    x = torch.randn(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        ks.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    q = torch.randn(1, 2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos and sin must be"):
        ks.rope(q, q, torch.ones(4, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="must have one shape"):
        ks.swiglu(x, x[:, :2])
    h, w = torch.randn(4, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    with pytest.raises(ValueError, match="reduction must be"):
        ks.linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long, device=DEVICE), reduction="max")
    with pytest.raises(TypeError, match="use the torch_ref kernel set"):
        ks.linear_cross_entropy(h.double(), w.double(), torch.zeros(4, dtype=torch.long, device=DEVICE))


@needs_kernels
def test_out_of_range_label_makes_the_loss_nan():
    """No host sync to check labels: a bad one poisons the loss instead of passing silently."""
    ks = _build("triton_cuda")
    h, w = torch.randn(4, 8, device=DEVICE), torch.randn(10, 8, device=DEVICE)
    labels = torch.tensor([1, 2, 10, -100], device=DEVICE)
    assert ks.linear_cross_entropy(h, w, labels).isnan().item()
    assert ks.linear_cross_entropy(h, w, labels.clamp(max=9)).isfinite().item()


@needs_kernels
def test_fused_cross_entropy_chunks_bound_the_logits():
    from slidekit_kernels.triton_common.cross_entropy import LOGITS_BUDGET_BYTES, auto_chunk

    chunk = auto_chunk(8192, 128256, 2)
    assert chunk == 512 and chunk * 128256 * 2 <= LOGITS_BUDGET_BYTES
    assert auto_chunk(3, 10, 4) == 3 and auto_chunk(10, 1 << 30, 2) == 1 and auto_chunk(0, 10, 2) == 1
