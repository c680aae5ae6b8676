"""The triton_cuda and triton_rocm kernel sets: conformance against torch_ref, convergence, availability.

One file, two modes:

* On a GPU the kernels are compiled: the conformance suite
  (``slidekit.testing.kernels``) runs both launch tables, NVIDIA's and AMD's
  (on an NVIDIA GPU the AMD table is just other block sizes), in float32 and
  bfloat16, and a tiny model trains 100 BF16 steps with each set and with torch_ref.
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

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.errors import DriverUnavailableError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSet, KernelSetDescriptor
from slidekit.testing.kernels import conformance_cases
from slidekit_kernels import triton_cuda, triton_rocm
from slidekit_kernels.triton_common.vendors import AMD, LAUNCH_CONFIGS, NVIDIA, LaunchConfig, availability

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available() and not INTERPRETED
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
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
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
            warps = cfg.num_warps(elements)
            assert 1 <= warps <= cfg.max_warps and warps & (warps - 1) == 0
        assert cfg.rows_per_tile(1 << 16) == 1 and cfg.rows_per_tile(64) == cfg.row_tile // 64
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(
            vendor="x", warp_size=32, max_warps=32, elems_per_thread=8, row_tile=3000,
            rms_bwd_programs_per_sm=1, elementwise_block=1024, ce_block=1024,
        )  # fmt: skip


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
