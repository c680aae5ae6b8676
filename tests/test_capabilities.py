"""Optimizer capabilities are declared, and checked: ``slidekit.capabilities`` and the optimizer kit.

A run refuses (``resolve.build_optimizer``) an optimizer that does not declare ``device_update`` and
``linear_state`` as bools, or whose ``linear_state = True`` its own ``state_layout`` contradicts; the
conformance kit (``slidekit.testing.optimizers``) also catches a ``linear_state = True`` that the
layout allows but ``step`` breaks (a per-unit quantity such as a trust ratio).
"""

from __future__ import annotations

import re
import unittest
from collections.abc import Iterator, Mapping

import pytest
import torch
from example_optimizer import MomentumSGD

from slidekit import ModelConfig, OptimConfig, Plugins, TrainConfig
from slidekit.capabilities import GRANULE, check_optimizer, layout_nonlinearity, state_is_linear
from slidekit.errors import PluginError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, OptimizerHyper, UnitOptimizer
from slidekit.resolve import build_optimizer, resolve
from slidekit.testing import optimizers as kit
from slidekit.testing.conformance import NotApplicable
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.adamw_fp8 import AdamWFp8
from slidekit_optim.layer_adam import LayerAdam

WHO = "optimizer 'fake' (plugin 'fakes')"
W = re.escape(WHO)


def momentum() -> MomentumSGD:
    """The example plugin's momentum SGD (elementwise: linear state, runs on any device)."""
    return MomentumSGD(OptimizerHyper())


class TrustRatio(MomentumSGD):
    """Momentum SGD with its step scaled by ||p|| / ||buffer|| over the tensors it is given (LAMB's
    trust ratio).

    Its layout is linear, but the update of an element depends on the whole unit, so a piece by
    piece update is not the whole one: declaring linear_state = True is a lie only ``step`` tells.
    """

    name = "trust_ratio"

    def __init__(self, hyper: OptimizerHyper | None = None) -> None:
        super().__init__(hyper or OptimizerHyper())

    def step(self, master: torch.Tensor, grad: torch.Tensor, state: Mapping[str, torch.Tensor], **kw) -> None:
        buf = state["momentum_buffer"] * self.momentum + grad.float()  # the buffer this step makes
        ratio = float(master.norm() / buf.norm().clamp_min(1e-12))
        super().step(master, grad, state, **{**kw, "lr": kw["lr"] * ratio})


class Layout(MomentumSGD):
    """An optimizer whose state_layout is given as a function of numel."""

    def __init__(self, layout, *, linear_state: object = True, device_update: object = True) -> None:
        self._layout = layout
        self.linear_state = linear_state  # type: ignore[assignment]
        self.device_update = device_update  # type: ignore[assignment]

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        return self._layout(numel)


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


# --------------------------------------------------------------------------- the declarations


@pytest.mark.parametrize(
    "make, device_update",
    [
        (lambda: LayerAdam(OptimizerHyper(), impl="torch"), True),
        (lambda: AdamW8bit(OptimizerHyper(), impl="torch"), True),
        (lambda: AdamWFp8(OptimizerHyper(), impl="torch"), False),  # host only
    ],
    ids=["layer_adam", "adamw_8bit", "adamw_fp8"],
)
def test_the_bundled_optimizers_declare_both_and_their_layouts_agree(make, device_update):
    opt = make()
    assert opt.device_update is device_update and opt.linear_state is True
    assert layout_nonlinearity(opt) is None
    check_optimizer(opt, who=WHO)


@pytest.mark.parametrize("attr", ["device_update", "linear_state"])
def test_a_missing_declaration_is_refused_naming_the_attribute_and_the_fix(attr):
    class Undeclared:
        name = "undeclared"
        state_layout = MomentumSGD.state_layout
        step = MomentumSGD.step

    declared = {"device_update": True, "linear_state": True}
    del declared[attr]
    opt = type("Partly", (Undeclared,), declared)()
    with pytest.raises(PluginError, match=rf"{W} does not declare {attr}: declare {attr} = True/False"):
        check_optimizer(opt, who=WHO)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
@pytest.mark.parametrize("attr", ["device_update", "linear_state"])
def test_a_declaration_that_is_not_a_bool_is_refused_naming_its_value(attr, value):
    opt = Layout(lambda n: {"buf": (torch.float32, n)}, **{attr: value})
    with pytest.raises(PluginError) as info:
        check_optimizer(opt, who=WHO)
    message = str(info.value)
    assert f"declares {attr} = {value!r} ({type(value).__name__}), which is not a bool" in message
    assert f"declare {attr} = True/False" in message


def test_an_object_that_is_no_optimizer_is_refused():
    with pytest.raises(PluginError, match=r"built object, which has no state_layout\(\) method"):
        check_optimizer(object(), who=WHO)


NONLINEAR = {
    "a per-unit scalar": (
        lambda n: {"m": (torch.float32, n), "step": (torch.float32, 1)},
        r"state 'step' of 4097 parameters has 1 elements, but those of parameters \[0, 4096\) and "
        r"\[4096, 4097\) would have 1 \+ 1 = 2",
    ),
    "blocks that do not divide the granule": (
        lambda n: {"codes": (torch.uint8, n), "scale": (torch.float32, _blocks(n, 3 * GRANULE // 2))},
        r"state 'scale' of 4097 parameters has 1 elements, but those of parameters \[0, 4096\) and "
        r"\[4096, 4097\) would have 1 \+ 1 = 2",
    ),
    "a dtype that depends on the size": (
        lambda n: {"m": (torch.float32 if n < 1 << 13 else torch.float16, n)},
        r"state 'm' is torch.float16 in state_layout\(8192\) but torch.float32 in state_layout\(4096\) and "
        r"torch.float32 in state_layout\(4096\)",
    ),
    "names that depend on the size": (
        lambda n: {"m": (torch.float32, n)} | ({"v": (torch.float32, n)} if n > 100 else {}),
        r"state_layout\(4097\) names \['m', 'v'\], but state_layout\(4096\) names \['m', 'v'\] and "
        r"state_layout\(1\) names \['m'\]",
    ),
    "a state_layout that raises": (
        lambda n: {"m": (torch.float32, n // (n - 1))},
        r"state_layout\(1\) raised ZeroDivisionError",
    ),
    "entries that are not (dtype, count)": (
        lambda n: {"m": ("float32", n)},
        r"state_layout\(4097\)\['m'\] is \('float32', 4097\); each entry is \(torch.dtype, element count >= 0\)",
    ),
}


@pytest.mark.parametrize("case", list(NONLINEAR), ids=list(NONLINEAR))
def test_linear_state_true_that_the_layout_contradicts_is_refused_with_a_counterexample(case):
    layout, counterexample = NONLINEAR[case]
    opt = Layout(layout)
    assert not state_is_linear(opt)
    with pytest.raises(
        PluginError, match=r"declares linear_state = True, but its state_layout is not linear"
    ) as info:
        check_optimizer(opt, who=WHO)
    assert info.value.args[0].startswith(WHO)
    assert "Declare linear_state = False" in str(info.value)
    assert layout_nonlinearity(opt) is not None
    assert re.search(counterexample, str(info.value)), str(info.value)


@pytest.mark.parametrize("case", list(NONLINEAR), ids=list(NONLINEAR))
def test_linear_state_false_is_never_contradicted(case):
    check_optimizer(Layout(NONLINEAR[case][0], linear_state=False), who=WHO)


@pytest.mark.parametrize("block", [1, 64, 256, 2048, GRANULE])
def test_block_wise_state_with_blocks_dividing_the_granule_is_linear(block):
    opt = Layout(lambda n: {"codes": (torch.uint8, n), "scale": (torch.float32, _blocks(n, block))})
    assert state_is_linear(opt)
    check_optimizer(opt, who=WHO)


def test_a_declared_false_with_a_linear_layout_is_allowed():
    check_optimizer(Layout(lambda n: {"buf": (torch.float32, n)}, linear_state=False), who=WHO)


# --------------------------------------------------------------------------- a run refuses them


class Fakes:
    def __init__(self, factory) -> None:
        self.factory = factory

    @hookimpl
    def slidekit_optimizers(self) -> Iterator[OptimizerDescriptor]:
        yield OptimizerDescriptor(name="fake", factory=self.factory)


def _build(tiny_model, factory) -> UnitOptimizer:
    cfg = TrainConfig(model=ModelConfig(source=str(tiny_model("llama"))), optim=OptimConfig(name="fake"))
    plugins = Plugins(extra=[("fakes", Fakes(factory))])
    return build_optimizer(cfg, resolve(cfg, plugins))


def test_a_run_refuses_an_optimizer_without_declarations_naming_the_plugin(tiny_model):
    class Old:  # an optimizer written before the declarations
        name = "old"
        linear_state = True
        state_layout = MomentumSGD.state_layout
        step = MomentumSGD.step

        def __init__(self, hyper: OptimizerHyper) -> None:
            self.hyper = hyper

    with pytest.raises(PluginError, match=rf"^{W} does not declare device_update: declare device_update"):
        _build(tiny_model, Old)


def test_a_run_refuses_a_contradicted_linear_state_naming_the_plugin(tiny_model):
    with pytest.raises(PluginError, match=rf"^{W} declares linear_state = True, but"):
        _build(tiny_model, lambda hyper: Layout(lambda n: {"m": (torch.float32, n + 1)}))


def test_a_run_builds_an_optimizer_that_declares_both(tiny_model):
    assert isinstance(_build(tiny_model, MomentumSGD), MomentumSGD)


# --------------------------------------------------------------------------- the conformance kit


@pytest.mark.parametrize("check", kit.CHECKS, ids=lambda c: c.__name__)
def test_the_kit_passes_a_conforming_optimizer(check):
    try:
        check(momentum)
    except NotApplicable:
        assert check in (kit.check_fused_backup, kit.check_update_out)  # optional capabilities it lacks
    except unittest.SkipTest:
        assert check is kit.check_device_update and not torch.cuda.is_available()


def test_the_kit_catches_a_linear_state_that_step_breaks():
    kit.check_declarations(TrustRatio)  # the layout alone cannot tell
    with pytest.raises(
        AssertionError, match=r"trust_ratio \(linear_state = True\), updated in pieces .*: master"
    ):
        kit.check_linear_state(TrustRatio)
    with pytest.raises(AssertionError):
        kit.check_optimizer(TrustRatio)


def test_the_kit_skips_what_is_declared_false_and_reports_bad_declarations():
    class Whole(TrustRatio):
        linear_state = False
        device_update = False

    for check in (kit.check_linear_state, kit.check_device_update):
        with pytest.raises(unittest.SkipTest, match=r"declares (linear_state|device_update) = False"):
            check(Whole)
    kit.check_optimizer(Whole)
    with pytest.raises(AssertionError, match=r"optimizer 'momentum_sgd' declares linear_state = 1 \(int\)"):
        kit.check_declarations(lambda: Layout(lambda n: {"buf": (torch.float32, n)}, linear_state=1))


def test_the_kit_catches_a_step_that_does_not_write_lowp_out():
    class NoCopy(MomentumSGD):
        def step(self, master, grad, state, *, lr, count, groups, lowp_out=None):
            super().step(master, grad, state, lr=lr, count=count, groups=groups, lowp_out=None)

    with pytest.raises(AssertionError, match="lowp_out against the updated master"):
        kit.check_step(lambda: NoCopy(OptimizerHyper()))


class OutOfPlace(MomentumSGD):
    """Momentum SGD declaring ``fused_update_out`` and ``fused_backup``: ``update_out`` gets a copy of the
    inputs, updated there, ``backup_out`` the inputs before an update in place (``in_place``: the inputs are
    updated and then copied, which the kit must catch; ``both``: it takes ``backup_out`` beside
    ``update_out``, ignoring it, which it must refuse)."""

    fused_update_out = True
    fused_backup = True

    def __init__(self, *, in_place: bool = False, both: bool = False) -> None:
        super().__init__(OptimizerHyper())
        self.in_place, self.both = in_place, both

    def step(self, master, grad, state, *, update_out=None, backup_out=None, **kw):
        if update_out is None:
            for k, t in ({"master": master, **state} if backup_out is not None else {}).items():
                backup_out[k].copy_(t)
            return super().step(master, grad, state, **kw)
        if backup_out is not None and not self.both:
            raise ValueError("pass backup_out or update_out, not both")
        if self.in_place:
            super().step(master, grad, state, **kw)
        for k, t in {"master": master, **state}.items():
            update_out[k].copy_(t)
        if not self.in_place:
            super().step(update_out["master"], grad, {k: update_out[k] for k in state}, **kw)
        return None


@pytest.mark.parametrize("fault", [None, "in_place", "both"])
def test_the_kit_holds_update_out_to_its_word(fault):
    make = {
        None: OutOfPlace,
        "in_place": lambda: OutOfPlace(in_place=True),
        "both": lambda: OutOfPlace(both=True),
    }
    if fault is None:
        kit.check_update_out(make[fault])
        kit.check_fused_backup(make[fault])
        return
    match = {"in_place": "which update_out leaves as it was", "both": "must refuse them"}[fault]
    with pytest.raises(AssertionError, match=match):
        kit.check_update_out(make[fault])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_the_device_check_skips_without_cuda():
    with pytest.raises(unittest.SkipTest, match="needs a CUDA device"):
        kit.check_device_update(momentum)
