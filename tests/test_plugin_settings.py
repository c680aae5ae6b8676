"""Plugin settings: ``plugins.options`` (TOML ``[plugins.options.NAME]``, CLI ``--plugin-option``) reach the
driver they name (tiers in ``TierContext.options``, optimizers in ``OptimizerHyper.options``, kernel sets as
``factory(options)``), and a setting nobody declared is refused before anything is built."""

from __future__ import annotations

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, PluginConfig, Plugins, TrainConfig, Trainer
from slidekit.cli import build_parser, config_from_args, main
from slidekit.config import from_dict, load_toml
from slidekit.errors import ConfigError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import (
    KernelSetDescriptor,
    OptimizerDescriptor,
    OptimizerHyper,
    TierContext,
    TierDescriptor,
)
from slidekit.plugins import parse_plugin_option
from slidekit.testing.models import random_batches
from slidekit_kernels.torch_ref import TorchRef
from slidekit_optim.layer_adam import LayerAdam
from slidekit_tiers.ram import RamTier


class Configurable:
    """A plugin with a tier, an optimizer and a kernel set that take settings, recording what they got."""

    def __init__(self) -> None:
        self.tier_options: list[dict] = []
        self.optimizer_options: list[dict] = []
        self.kernel_options: list[dict] = []

    def _tier(self, ctx: TierContext) -> RamTier:
        self.tier_options.append(dict(ctx.options))
        if ctx.options.get("queue_depth", 1) < 1:
            raise ValueError(f"queue_depth must be >= 1, got {ctx.options['queue_depth']!r}")
        return RamTier(ctx)

    def _optimizer(self, hyper: OptimizerHyper) -> LayerAdam:
        self.optimizer_options.append(dict(hyper.options))
        opt = LayerAdam(hyper, impl="torch")
        opt.name = "tuned_adam"
        return opt

    def _kernels(self, options) -> TorchRef:
        self.kernel_options.append(dict(options))
        return TorchRef()

    @hookimpl
    def slidekit_storage_tiers(self):
        yield TierDescriptor(
            name="tuned_ram",
            factory=self._tier,
            options={"queue_depth": "transfers in flight (default 1)", "label": "a name for the logs"},
        )

    @hookimpl
    def slidekit_optimizers(self):
        yield OptimizerDescriptor(
            name="tuned_adam", factory=self._optimizer, options={"warm": "start warm (default false)"}
        )

    @hookimpl
    def slidekit_kernel_sets(self):
        yield KernelSetDescriptor(name="tuned_ref", factory=self._kernels, options={"block": "tile size"})


def _config(tiny_model, options, **engine) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(name="tuned_adam", lr=1e-3),
        engine=EngineConfig(
            device="cpu", compute_dtype="float32", state_tier="tuned_ram", kernels="tuned_ref", **engine
        ),
        plugins=PluginConfig(options=options),
    )


def test_each_driver_gets_its_own_settings_and_only_those(tiny_model):
    plugin = Configurable()
    options = {
        "tuned_ram": {"queue_depth": 4, "label": "fast"},
        "tuned_adam": {"warm": True},
        "tuned_ref": {"block": 64},
    }
    plugins = Plugins(entry_points=["ram"], extra=[("configurable", plugin)])
    with Trainer(_config(tiny_model, options), plugins=plugins) as t:
        losses = t.fit(random_batches(128, steps=2)).losses
    assert plugin.tier_options == [{"queue_depth": 4, "label": "fast"}]
    assert plugin.optimizer_options == [{"warm": True}]
    assert plugin.kernel_options == [{"block": 64}]
    assert len(losses) == 2

    bare = Configurable()  # no settings: every driver is built with {}
    plugins = Plugins(entry_points=["ram"], extra=[("configurable", bare)])
    with Trainer(_config(tiny_model, {}), plugins=plugins):
        pass
    assert bare.tier_options == bare.optimizer_options == bare.kernel_options == [{}]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tuned_ram": {"queue_dpeth": 4}},
            r"plugins\.options\.tuned_ram: storage tier 'tuned_ram' \(plugin 'configurable'\) has no setting "
            r"'queue_dpeth'; it takes label \(a name for the logs\); queue_depth \(transfers in flight",
        ),
        (
            {"ram": {"pin": False}},
            r"plugins\.options\.ram: storage tier 'ram' \(plugin 'ram'\) has no setting 'pin'; it takes no "
            r"settings",
        ),
        (
            {"tuned_rma": {"queue_depth": 4}},
            r"plugins\.options has settings for 'tuned_rma', but no driver is called that; drivers: .*tuned_ram",
        ),
        (
            {"layer_adam": {"x": 1}},  # a driver this run does not use still takes only what it declares
            r"plugins\.options\.layer_adam: optimizer 'layer_adam' \(plugin 'layer_adam'\) has no setting 'x'",
        ),
    ],
)
def test_a_setting_nobody_declared_is_refused_before_anything_is_built(tiny_model, options, message):
    plugin = Configurable()
    plugins = Plugins(entry_points=["ram", "layer_adam"], extra=[("configurable", plugin)])
    with pytest.raises(ConfigError, match=message):
        Trainer(_config(tiny_model, options), plugins=plugins)
    assert plugin.tier_options == plugin.optimizer_options == plugin.kernel_options == []


def test_a_bad_value_is_the_drivers_to_refuse(tiny_model):
    plugins = Plugins(entry_points=["ram"], extra=[("configurable", Configurable())])
    with pytest.raises(ValueError, match=r"queue_depth must be >= 1, got 0"):
        Trainer(_config(tiny_model, {"tuned_ram": {"queue_depth": 0}}), plugins=plugins)


def test_existing_drivers_take_the_hyper_parameters_they_always_did():
    assert OptimizerHyper().options == {}
    opt = LayerAdam(OptimizerHyper(betas=(0.8, 0.9), options={}), impl="torch")
    master, grad = torch.ones(8), torch.full((8,), 0.5)
    state = {k: torch.zeros(n, dtype=dt) for k, (dt, n) in opt.state_layout(8).items()}
    opt.step(master, grad, state, lr=0.1, count=1, groups=[])
    assert torch.allclose(master, torch.full((8,), 0.9))  # Adam's first step moves by lr


# --------------------------------------------------------------------------- where settings come from


def test_settings_from_toml_and_the_command_line_land_in_plugins_options(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[plugins.options.posix]\nqueue_depth = 4\nmode = "direct"\n[plugins.options.other]\nx = 1\n'
    )
    args = build_parser().parse_args(
        [
            "finetune",
            "--config",
            str(toml),
            "--plugin-option",
            "posix.queue_depth=8",  # the flag wins over the file, key by key
            "--plugin-option",
            "my_tier.paths=['/a', '/b']",
            "--plugin-option",
            "my_tier.label=fast lane",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.plugins.options == {
        "posix": {"queue_depth": 8, "mode": "direct"},
        "other": {"x": 1},
        "my_tier": {"paths": ["/a", "/b"], "label": "fast lane"},
    }
    assert from_dict(cfg.to_dict()) == cfg  # saved with the run, read back the same
    assert from_dict(load_toml(str(toml))).plugins.options["posix"] == {"queue_depth": 4, "mode": "direct"}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("posix.queue_depth=8", ("posix", "queue_depth", 8)),
        ("a.ratio = 0.5", ("a", "ratio", 0.5)),
        ("a.on=true", ("a", "on", True)),
        ('a.s="x=y"', ("a", "s", "x=y")),
        ("a.path=/mnt/nvme0", ("a", "path", "/mnt/nvme0")),
        ("a.b.c=1", ("a", "b.c", 1)),
    ],
)
def test_a_plugin_option_reads_its_value_as_toml_or_as_a_string(text, want):
    assert parse_plugin_option(text) == want


@pytest.mark.parametrize("text", ["posix", "posix=8", ".x=1", "posix.=1"])
def test_a_malformed_plugin_option_is_refused_with_the_form_it_takes(text, capsys):
    with pytest.raises(ConfigError, match=r"--plugin-option takes DRIVER\.KEY=VALUE"):
        parse_plugin_option(text)
    assert main(["finetune", "--plugin-option", text]) == 2
    assert "--plugin-option takes DRIVER.KEY=VALUE (e.g. posix.queue_depth=8)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"posix": 8},
            r"plugins\.options\.posix must be a table of settings \(TOML \[plugins\.options\.posix\]\)",
        ),
        ({"posix": {"depth": None}}, r"plugins\.options\.posix\.depth must be a string, a boolean, a finite"),
        ({"posix": {"depth": float("inf")}}, r"plugins\.options\.posix\.depth must be .* got inf"),
        ({"posix": {"depth": {"nested": 1}}}, r"plugins\.options\.posix\.depth must be"),
    ],
)
def test_settings_are_plain_values(options, message):
    with pytest.raises(ConfigError, match=message):
        PluginConfig(options=options)


def test_slidekit_plugins_lists_the_settings_a_driver_takes(capsys, monkeypatch):
    import slidekit.plugins as plugins_module

    real = plugins_module.Plugins

    def with_configurable(**kw):
        return real(**kw, extra=[("configurable", Configurable())])

    monkeypatch.setattr(plugins_module, "Plugins", with_configurable)
    assert main(["plugins"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tier       tuned_ram"))
    assert row.endswith("runs anywhere; settings: queue_depth, label")
