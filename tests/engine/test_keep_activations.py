"""Resident layers that keep their activations instead of recomputing them (``engine.recompute``).

- keeping is bitwise the recompute path: losses, gradient norms and every parameter, with some or
  all layers keeping, gradient accumulation over micro-batches of different lengths, tied and
  untied embeddings, both optimizers, clipping; and it matches transformers + torch.optim.AdamW;
- the planner keeps the last layers that the device memory left holds (a Machine built by hand),
  "all" keeps none, "none" refuses sliding layers, a layout in which a sliding unit keeps is refused;
- ``estimate.kept_bytes`` against the tensors autograd really saves for a layer, several shapes, for
  ``torch_ref`` here and for the Triton kernel set under ``TRITON_INTERPRET=1`` (a subprocess).

Run: ``pytest tests/engine/test_keep_activations.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.errors import ConfigError, NonFiniteError
from slidekit.models.decoder import RopeTables, layer_forward
from slidekit.planning import GIB, Machine, Placement, Planner, Workload
from slidekit.planning.estimate import DEVICE_HEADROOM, DEVICE_SLACK, kept_bytes
from slidekit.planning.keeping import check_keeps, plan_keeps
from slidekit.planning.planner import RESIDENT_RESERVE
from slidekit.plugins import Plugins
from slidekit.testing.asserts import assert_losses_close, assert_states_close, rel_error
from slidekit.testing.models import tiny_config
from slidekit.testing.reference import reference_run

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
LR, WD, VOCAB = 1e-3, 0.1, 128


def _steps(seed: int, lengths: list[tuple[int, int]]) -> list[Batch]:
    """Micro-batches of two per step, of different lengths: 2 rows of ``a`` tokens, then 3 of ``b``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for a, b in lengths:
        for rows, t in ((2, a), (3, b)):
            ids = torch.randint(0, VOCAB, (rows, t + 1), generator=gen)
            labels = ids[:, 1:].clone()
            labels[0, :2] = -100
            out.append(Batch(ids[:, :-1].contiguous(), labels))
    return out


def _config(
    model_dir, recompute: str, dtype: str, optimizer: str, clip: float | None, **engine: object
) -> TrainConfig:
    engine = {"gpu_resident": "all", **engine}
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(name=optimizer, lr=LR, weight_decay=WD, max_grad_norm=clip),
        engine=EngineConfig(device="cpu", compute_dtype=dtype, recompute=recompute, **engine),  # type: ignore[arg-type]
        steps=3,
        grad_accum=2,
    )


def _machine(device_free: int | None) -> Machine:
    """This CPU, with ``device_free`` standing for a GPU's free memory (None: the CPU's own planning)."""
    return Machine(
        device_type="cpu",
        device_free=device_free,
        device_total=device_free,
        host_available=64 * GIB,
        host_total=64 * GIB,
    )


def _free_for(planner: Planner, keeping: int) -> int:
    """Device memory that lets "auto" keep exactly ``keeping`` layers of ``planner``'s all-resident run
    (half a layer's graphs to spare): the planner's budget arithmetic, written out."""
    w, s = planner.workload, planner.itemsize
    boundary = w.grad_accum * w.tokens * planner.spec.hidden_size * s
    per_layer = w.grad_accum * kept_bytes(planner.spec, w.tokens, s, fused_kernels=planner.fused_kernels)
    placement = Placement(gpu_resident="all")
    base = planner.estimate(placement, _machine(None), [True] * len(planner.numels))
    need = base.device_bytes  # no layer keeps on the CPU's own planning
    room = need + keeping * (per_layer - boundary) + boundary + per_layer // 2
    return int(RESIDENT_RESERVE + DEVICE_SLACK + room * (1 + DEVICE_HEADROOM)) + 1


def _run(model_dir, recompute: str, *, dtype="bfloat16", optimizer="layer_adam", clip=None, free=None, **engine):
    cfg = _config(model_dir, recompute, dtype, optimizer, clip, **engine)
    machine = None if free is None else _machine(free)
    with Trainer(cfg, machine=machine) as t:
        keeps = [u.index for u in t.engine.layout.units if u.keeps]
        init = t.state_dict()
        result = t.fit(_steps(3, [(24, 40), (40, 17), (9, 33)]))
        return keeps, init, result, t.state_dict(), t


# ---------------------------------------------------------------------------- bitwise the recompute path


@pytest.mark.parametrize(
    ("family", "optimizer", "clip"),
    [
        ("qwen2", "layer_adam", None),  # tied embeddings
        ("llama", "layer_adam", 0.5),  # untied, biases, clipping (deferred updates)
        ("qwen3", "adamw_8bit", None),  # q/k norms, the 8-bit optimizer
    ],
)
def test_keeping_is_bitwise_the_recompute_path(family, optimizer, clip, tiny_model):
    """Every layer keeping, and the last two of three (planned for a device of just that much free
    memory), give the very bits of every layer recomputing, in BF16."""
    model_dir = tiny_model(family)
    base_keeps, _, base, base_state, t = _run(model_dir, "all", optimizer=optimizer, clip=clip)
    assert base_keeps == []
    assert t.planner is not None
    free = _free_for(t.planner, 2)
    for recompute, free_, want in (("none", None, [1, 2, 3]), ("auto", free, [2, 3])):
        keeps, _, other, state, _ = _run(model_dir, recompute, optimizer=optimizer, clip=clip, free=free_)
        assert keeps == want, recompute
        assert other.losses == base.losses, recompute
        assert other.grad_norms == base.grad_norms, recompute
        for name, value in base_state.items():
            assert state[name].equal(value), f"{recompute}: {name}"
    if clip is not None:
        assert max(base.grad_norms) > clip, "the test must actually clip"


@pytest.mark.parametrize(
    ("family", "optimizer", "clip", "engine"),
    [
        ("qwen2", "layer_adam", None, {"gpu_resident": "none", "window": 2}),  # tied, every layer slides
        ("llama", "adamw_8bit", 0.5, {"gpu_resident": "0.5", "window": 2}),  # half slide, clipping
        ("qwen3", "layer_adam", None, {"gpu_resident": "all", "resident_weights": "slide", "window": 2}),
    ],
    ids=["forced offload", "half resident, clipped", "resident, weights slide"],
)
def test_sliding_layers_that_keep_are_bitwise_the_recompute_path(family, optimizer, clip, engine, tiny_model, monkeypatch):
    """Sliding layers that keep give the recompute's very bits, and their graphs read their weights
    through the references: bound to a cache unit of NaN instead, the step refuses its non-finite
    gradients. (That the
    references survive the cache unit being overwritten is the next test's; the window here often
    hands a layer's backward its forward's cache unit back.)"""
    from slidekit.engine.activations import KeptGraphs

    model_dir = tiny_model(family)
    base_keeps, _, base, base_state, _ = _run(model_dir, "all", optimizer=optimizer, clip=clip, **engine)
    assert base_keeps == []
    keeps, _, other, state, _ = _run(model_dir, "none", optimizer=optimizer, clip=clip, **engine)
    assert keeps == [1, 2, 3]
    assert other.losses == base.losses
    assert other.grad_norms == base.grad_norms
    for name, value in base_state.items():
        assert state[name].equal(value), name
    if clip is not None:
        assert max(base.grad_norms) > clip, "the test must actually clip"

    bound = KeptGraphs.bound
    sliding = []

    def bound_to_nan(self, unit, params, leaves):
        sliding.extend([unit] if unit in self._leaves else [])
        return bound(self, unit, torch.full_like(params, float("nan")), leaves)

    monkeypatch.setattr(KeptGraphs, "bound", bound_to_nan)
    cfg = _config(model_dir, "none", "bfloat16", optimizer, None, **engine)
    with Trainer(cfg) as t, pytest.raises(NonFiniteError, match="not finite"):
        t.fit(_steps(3, [(24, 40)]))
    assert sliding


def test_a_kept_graph_reads_its_weights_from_the_cache_unit_bound_at_its_backward():
    """``KeptGraphs`` by hand: a graph built over one weight buffer, that buffer then overwritten, and
    the backward bound to another holding the same weights: the input's and the weights' gradients
    are a plain autograd run's, the weight gradients land in the bound buffer's gradients, and the
    forward's leaves get their own gradient buffers back."""
    from slidekit.engine.activations import KeptGraphs

    torch.manual_seed(0)
    rows, cols = 6, 8

    def leaves_of(params: torch.Tensor, grads: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, (at, shape) in {"w": (0, (rows, cols)), "g": (rows * cols, (cols,))}.items():
            n = math.prod(shape)
            leaf = params[at : at + n].view(shape).detach().requires_grad_(True)
            leaf.grad = grads[at : at + n].view(shape)
            out[name] = leaf
        return out

    def layer(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.linear(x * w["g"], w["w"]).tanh() @ w["w"]  # w saved twice, transposed

    numel = rows * cols + cols
    weights = torch.randn(numel)
    x0, dy = torch.randn(4, cols), torch.randn(4, cols)
    ref_w = {k: v.detach().clone().requires_grad_(True) for k, v in leaves_of(weights.clone(), torch.zeros(numel)).items()}
    ref_x = x0.clone().requires_grad_(True)
    layer(ref_x, ref_w).backward(dy)

    p1, g1 = weights.clone(), torch.zeros(numel)
    p2, g2 = torch.zeros(numel), torch.zeros(numel)
    forward = leaves_of(p1, g1)
    kept = KeptGraphs()
    x = x0.clone().requires_grad_(True)
    with kept.saving_weights(5, p1, forward):
        y = layer(x, forward)
    p1.fill_(float("nan"))  # another unit takes the cache unit
    p2.copy_(weights)  # the backward's cache unit holds the layer again
    with kept.bound(5, p2, leaves_of(p2, g2)):
        y.backward(dy)
    assert x.grad is not None and x.grad.equal(ref_x.grad)
    assert g2[: rows * cols].view(rows, cols).equal(ref_w["w"].grad) and g2[rows * cols :].equal(ref_w["g"].grad)
    assert not g1.any()  # nothing went to the forward's cache unit
    assert forward["w"].grad.data_ptr() == g1.data_ptr()  # its leaves' buffers are their own again


def test_keeping_matches_transformers_and_adamw(tiny_model):
    """Every layer keeping, FP32: the transformers model with torch.optim.AdamW, over the same steps."""
    model_dir = tiny_model("llama")
    _, init, result, state, t = _run(model_dir, "none", dtype="float32", clip=1.0)
    micro = _steps(3, [(24, 40), (40, 17), (9, 33)])
    steps = [micro[i : i + 2] for i in range(0, len(micro), 2)]
    ref = reference_run(t.hf_config, init, steps, lr=LR, weight_decay=WD, max_grad_norm=1.0)
    assert_losses_close(result.losses, ref.losses, rtol=1e-5)
    assert_states_close(state, ref.state, rtol=1e-5)
    assert max(rel_error(ref.state[n], init[n]) for n in init) > 1e-3, "the steps must move the parameters"


# ---------------------------------------------------------------------------- the planner's choice


def _planner(recompute: str = "auto", family: str = "llama", layers: int = 6) -> Planner:
    hf = tiny_config(family, num_hidden_layers=layers)
    spec = Plugins().adapter_for(hf.model_type).descriptor.factory(hf)
    return Planner(
        spec,
        Workload(batch_size=4, seq_len=32, grad_accum=2),
        compute_itemsize=2,
        state_bytes=lambda n: 8 * n,
        media={"ram": "host", "gpu": "device"},
        device_type="cuda",
        recompute=recompute,
    )


def _gpu(free: int) -> Machine:
    return Machine(device_type="cuda", device_free=free, device_total=free, host_available=64 * GIB,
                   host_total=64 * GIB)  # fmt: skip


@pytest.mark.parametrize("keeping", [0, 1, 3, 6])
def test_auto_keeps_the_last_layers_the_free_memory_holds(keeping):
    p = _planner()
    free = _free_for(p, keeping)
    layout = p.layout(Placement(gpu_resident="all"), _gpu(free))
    assert [u.index for u in layout.units if u.keeps] == list(range(7 - keeping, 7))
    est = p.estimate_layout(layout, _gpu(free))
    assert est.placement_fits(_gpu(free))
    w = p.workload
    boundary = w.grad_accum * w.tokens * p.spec.hidden_size * 2
    assert est.device["activations"] == (6 - keeping) * boundary  # keeping layers save no boundary
    graphs = keeping * w.grad_accum * kept_bytes(p.spec, w.tokens, 2)
    assert est.device.get("kept", 0) == (graphs + boundary if keeping else 0)
    assert ("keeps its activations" in layout.describe()) == bool(keeping)
    assert f"{keeping} of 6 layers keep their activations" in layout.describe()


def test_all_keeps_none_and_none_keeps_every_layer():
    big = _gpu(80 * GIB)
    assert not any(u.keeps for u in _planner("all").layout(Placement(gpu_resident="all"), big).units)
    layout = _planner("none").layout(Placement(gpu_resident="all"), big)
    assert [u.keeps for u in layout.units] == [False, *[True] * 6, False]


def test_sliding_layers_keep_too():
    """Units spread over the backward order stay on the host: "auto" keeps the layers from the top down,
    resident or sliding, while the budget lasts; "none" keeps every layer, sliding ones included."""
    p = _planner()
    resident = [True, True, False, True, True, False, True, True]
    keeps = plan_keeps(["embed", *["layer"] * 6, "head"], recompute="auto", per_layer=2, fixed=1, budget=7)
    assert keeps == [False, False, False, False, True, True, True, False]  # 1 + 3 x 2 of the 7
    layout = _planner("none").layout(Placement(gpu_resident="all"), _gpu(80 * GIB), resident)
    assert [u.keeps for u in layout.units] == [False, *[True] * 6, False]
    layout = p.layout(Placement(gpu_resident="all"), _gpu(80 * GIB), resident)
    assert [u.keeps for u in layout.units] == [False, *[True] * 6, False]  # 80 GiB hold every graph
    offloaded = p.layout(Placement(gpu_resident="none"), _gpu(80 * GIB))
    assert [u.keeps for u in offloaded.units] == [False, *[True] * 6, False]


def test_only_decoder_layers_keep():
    p = _planner()
    layout = p.layout(Placement(gpu_resident="none"), _gpu(80 * GIB))
    head = tuple(dataclasses.replace(u, keeps=u.index == 7) for u in layout.units)
    with pytest.raises(ConfigError, match=r"units 7 are to keep their activations, but only decoder layers"):
        check_keeps(head)  # what build_layout and the engine's constructor call
    embed = tuple(i == 0 for i in range(8))  # nor may the embedding
    with pytest.raises(ConfigError, match="units 0 are to keep"):
        p._layout(Placement(gpu_resident="all"), [True] * 8, embed)


def test_recompute_is_validated():
    with pytest.raises(ConfigError, match=r"engine.recompute \(CLI: --recompute\) must be 'auto', 'all' or 'none'"):
        EngineConfig(recompute="some")


# ---------------------------------------------------------------------------- the saved bytes


SHAPES = [
    ("llama", {}, 2, 16),  # GQA 4/2, biases
    ("qwen3", {"intermediate_size": 160, "num_attention_heads": 8, "head_dim": 8}, 3, 24),  # q/k norms
    ("qwen2", {"num_key_value_heads": 4, "intermediate_size": 40}, 1, 40),  # no GQA
]


def _saved_bytes(
    family: str, overrides: dict, batch: int, seq: int, dtype: torch.dtype, kernels: object
) -> tuple[int, object]:
    """Bytes of the distinct storages a layer's graph saves, beyond its weights and the RoPE tables."""
    hf = tiny_config(family, **overrides)
    spec = Plugins().adapter_for(hf.model_type).descriptor.factory(hf)
    unit = spec.units[1]
    flat = (torch.randn(unit.numel, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    w = {k: v.detach().requires_grad_(True) for k, v in unit.views(flat).items()}
    cos, sin = RopeTables(spec).get(seq, torch.device("cpu"), dtype)
    shared = {t.untyped_storage().data_ptr() for t in (flat, cos, sin)}
    x = torch.randn(batch, seq, spec.hidden_size, dtype=dtype).requires_grad_(True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in shared:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer_forward(spec, w, x, cos, sin, kernels)
    y.sum().backward()  # the graph it kept is whole
    return sum(storages.values()), spec


def _check_saved(kernels, fused: bool) -> None:
    for family, overrides, batch, seq in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            real, spec = _saved_bytes(family, overrides, batch, seq, dtype, kernels)
            want = kept_bytes(spec, batch * seq, dtype.itemsize, fused_kernels=fused)
            assert abs(want - real) <= 0.02 * real, f"{family} {dtype} B={batch} T={seq}: {want} vs {real}"


@pytest.mark.skipif(INTERPRETED, reason="the Triton kernels' run")
def test_kept_bytes_are_what_torch_ref_saves():
    from slidekit_kernels.torch_ref import TorchRef

    _check_saved(TorchRef(), fused=False)


@pytest.mark.skipif(not INTERPRETED, reason="runs in test_kept_bytes_of_the_triton_kernels' subprocess")
def test_kept_bytes_are_what_the_triton_kernels_save():
    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet
    from slidekit_kernels.triton_common.vendors import NVIDIA

    _check_saved(TritonKernelSet("triton_cuda", NVIDIA), fused=True)


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreted run")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kept_bytes_of_the_triton_kernels():
    """The Triton kernel set's autograd functions save the same tensors on CPU tensors as on a GPU:
    this file's Triton check again, under the interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton_kernels_save"],
        env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and re.search(r"\b1 passed", out), out[-4000:]
