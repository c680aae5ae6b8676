"""The out-of-tree example plugin in docs/: installed with pip, discovered through its entry point, used.

pip builds and installs docs/examples/slidekit-example-tier into a temporary
directory put on sys.path, which is how an installed third-party distribution
looks to importlib.metadata. slidekit must find it with no help, list it,
and train with it to the same bits as the bundled ram tier.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches
from slidekit.testing.tiers import DEVICE_CHECKS, check_tier

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "slidekit-example-tier"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",  # no look-up on the package index: nothing to wait for
            "--no-deps",
            "--no-build-isolation",
            "--no-compile",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        timeout=600,  # only turns a hang into a failure: the build takes seconds
    )
    sys.path.insert(0, str(target))
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        for name in [m for m in sys.modules if m.startswith("slidekit_example_tier")]:
            del sys.modules[name]


def test_discovered_through_its_entry_point(installed_example):
    plugins = Plugins()
    assert "example_tier" in plugins.plugin_names()
    reg = plugins.get("tier", "crc32_ram")
    assert reg.plugin == "example_tier"
    assert any(r["name"] == "crc32_ram" and r["available"] for r in plugins.listing())


def test_not_loaded_when_blocked_or_autoload_off(installed_example, monkeypatch):
    assert "example_tier" not in Plugins(block=["example_tier"]).plugin_names()
    monkeypatch.setenv("SLIDEKIT_BLOCK_PLUGINS", "example_tier")
    assert "example_tier" not in Plugins().plugin_names()
    monkeypatch.delenv("SLIDEKIT_BLOCK_PLUGINS")
    monkeypatch.setenv("SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert Plugins().plugin_names() == ["slidekit.models"]


def test_passes_the_tier_checks(installed_example):
    from slidekit.interfaces import TierContext

    desc = Plugins().get("tier", "crc32_ram").descriptor
    import torch

    outcome = check_tier(
        lambda: desc.factory(TierContext(device=torch.device("cpu"))), allow_skips=DEVICE_CHECKS
    )
    assert outcome.driver == "tier 'crc32_ram'" and len(outcome.passed) >= 13


def test_training_with_it_matches_the_ram_tier_bitwise(installed_example, tiny_model):
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=3)

    def run(tier: str):
        cfg = TrainConfig(
            model=ModelConfig(source=str(model_dir)),
            optim=OptimConfig(lr=1e-3),
            engine=EngineConfig(device="cpu", state_tier=tier, activation_tier=tier),
        )
        with Trainer(cfg) as t:
            result = t.fit(batches)
            return result.losses, t.state_dict()

    ram_losses, ram_state = run("ram")
    crc_losses, crc_state = run("crc32_ram")
    assert crc_losses == ram_losses
    assert_states_equal(crc_state, ram_state)


# --------------------------------------------------------------------------- its optimizer


def _sgd(installed_example, **hyper):
    from slidekit.interfaces import OptimizerHyper

    desc = Plugins().get("optimizer", "momentum_sgd").descriptor
    return lambda: desc.factory(OptimizerHyper(**hyper))


def test_the_optimizer_passes_the_optimizer_checks(installed_example):
    from slidekit.testing.optimizers import DEVICE_CHECKS, check_optimizer

    make = _sgd(installed_example, betas=(0.8, 0.999))
    assert (make().device_update, make().linear_state) == (True, True)
    outcome = check_optimizer(make, allow_skips=DEVICE_CHECKS)  # runs on a CUDA machine
    # It declares both required capabilities, so each is checked; not the optional fused_backup and
    # fused_update_out.
    assert list(outcome.not_applicable) == ["check_fused_backup", "check_update_out"]


def test_the_optimizer_follows_torch_sgd(installed_example):
    import torch

    from slidekit.interfaces import ParamGroupRange

    n, decayed = 5000, 3000  # elements [0, 3000) decay, the rest do not
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(6)]
    opt = _sgd(installed_example, betas=(0.9, 0.999))()
    master, state = init.clone(), {"momentum_buffer": torch.zeros(n)}
    groups = [ParamGroupRange(start=0, stop=decayed, weight_decay=0.1)]
    a, b = init[:decayed].clone().requires_grad_(), init[decayed:].clone().requires_grad_()
    ref = torch.optim.SGD(
        [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
        lr=0.05,
        momentum=0.9,
        foreach=False,
    )
    for count, g in enumerate(grads, 1):
        opt.step(master, g, state, lr=0.05, count=count, groups=groups)
        a.grad, b.grad = g[:decayed].clone(), g[decayed:].clone()
        ref.step()
    torch.testing.assert_close(master, torch.cat([a.detach(), b.detach()]), rtol=1e-6, atol=1e-7)


def test_training_with_the_optimizer_streamed_in_pieces_matches_it_mapped(installed_example, tiny_model):
    """linear_state = True at work: state in crc32_ram (not mapped) is streamed in pieces of one granule;
    in ram (mapped) each unit is updated whole. Same bits."""
    from slidekit.capabilities import GRANULE

    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=3)

    def run(tier: str, chunk: int):
        cfg = TrainConfig(
            model=ModelConfig(source=str(model_dir)),
            optim=OptimConfig(name="momentum_sgd", lr=1e-2, weight_decay=0.1),
            engine=EngineConfig(device="cpu", state_tier=tier, state_chunk=chunk),
        )
        with Trainer(cfg) as t:
            result = t.fit(batches)
            return result.losses, t.state_dict()

    whole_losses, whole_state = run("ram", 1 << 22)
    pieces_losses, pieces_state = run("crc32_ram", GRANULE)
    assert pieces_losses == whole_losses
    assert_states_equal(pieces_state, whole_state)
