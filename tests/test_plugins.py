"""The plugin manager: discovery, validation, duplicates, blocking, selection and its messages.

Each test builds a fresh ``Plugins``; test plugins are registered through
``extra`` (never by touching pluggy internals) and vanish with the manager.
"""

from __future__ import annotations

import pytest

from slidekit import Plugins
from slidekit.errors import DriverUnavailableError, DuplicateDriverError, PluginError, UnknownDriverError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSetDescriptor, OptimizerDescriptor, TierDescriptor
from slidekit_tiers.ram import RamTier


def _tier(name: str, *, priority: int = 0, available=None, devices=("cpu", "cuda", "rocm")) -> TierDescriptor:
    kwargs = {"available": available} if available else {}
    return TierDescriptor(name=name, factory=RamTier, priority=priority, devices=devices, **kwargs)


class TierPlugin:
    def __init__(self, *descs: TierDescriptor) -> None:
        self.descs = descs

    @hookimpl
    def slidekit_storage_tiers(self):
        yield from self.descs


def test_bundled_plugins_come_from_entry_points():
    plugins = Plugins()
    assert {"ram", "layer_adam", "torch_ref", "slidekit.models"} <= set(plugins.plugin_names())
    assert plugins.get("tier", "ram").plugin == "ram"
    assert plugins.get("optimizer", "layer_adam").plugin == "layer_adam"
    assert plugins.get("kernels", "torch_ref").plugin == "torch_ref"
    assert {r.name for r in plugins.drivers("model")} == {"llama", "qwen2", "qwen3", "mistral"}


def test_entry_points_can_be_off_or_narrowed():
    assert Plugins(entry_points=False).plugin_names() == ["slidekit.models"]
    assert Plugins(entry_points=["ram"]).plugin_names() == ["ram", "slidekit.models"]


def test_duplicate_names_are_rejected_naming_both_plugins():
    plugins = Plugins(entry_points=["ram"], extra=[("dup", TierPlugin(_tier("ram")))])
    with pytest.raises(
        DuplicateDriverError, match=r"'ram'.*plugin 'ram'.*plugin 'dup'|'ram'.*plugin 'dup'.*plugin 'ram'"
    ):
        plugins.drivers("tier")


def test_unknown_name_lists_the_choices():
    plugins = Plugins(entry_points=["ram"], extra=[("t", TierPlugin(_tier("nvme_fast")))])
    with pytest.raises(
        UnknownDriverError, match=r"unknown storage tier 'nope'; choose one of: nvme_fast, ram"
    ):
        plugins.select("tier", "nope", "cpu")


def test_blocked_plugins_stay_out(monkeypatch):
    assert "torch_ref" not in Plugins(block=["torch_ref"]).plugin_names()
    monkeypatch.setenv("SLIDEKIT_BLOCK_PLUGINS", "torch_ref, ram")
    plugins = Plugins()
    assert not {"torch_ref", "ram"} & set(plugins.plugin_names())
    with pytest.raises(UnknownDriverError, match="blocked plugins: ram, torch_ref"):
        plugins.get("tier", "ram")
    blocked_extra = Plugins(block=["mine"], extra=[("mine", TierPlugin(_tier("x")))])
    assert "x" not in {r.name for r in blocked_extra.drivers("tier")}


def test_explicit_unavailable_driver_gives_reason_and_alternatives():
    plugins = Plugins(
        entry_points=["ram"],
        extra=[("t", TierPlugin(_tier("gpu_only", available=lambda: (False, "no CUDA driver here"))))],
    )
    with pytest.raises(
        DriverUnavailableError,
        match=r"'gpu_only' is unavailable: no CUDA driver here; available alternatives: ram",
    ):
        plugins.select("tier", "gpu_only", "cpu")


def test_explicit_driver_for_another_device_is_refused():
    plugins = Plugins(entry_points=["ram"], extra=[("t", TierPlugin(_tier("cudaonly", devices=("cuda",))))])
    with pytest.raises(DriverUnavailableError, match="does not run on cpu"):
        plugins.select("tier", "cudaonly", "cpu")


def test_auto_takes_the_best_available_and_says_why():
    plugins = Plugins(
        entry_points=False,
        extra=[
            (
                "t",
                TierPlugin(
                    _tier("fast", priority=50, available=lambda: (False, "needs hardware")),
                    _tier("medium", priority=20),
                    _tier("slow", priority=10),
                ),
            )
        ],
    )
    sel = plugins.select("tier", "auto", "cpu")
    assert sel.name == "medium" and sel.automatic
    assert "auto-selected storage tier 'medium'" in sel.reason
    assert "skipped 'fast': needs hardware" in sel.reason


def test_auto_with_nothing_available_explains():
    plugins = Plugins(
        entry_points=False, extra=[("t", TierPlugin(_tier("a", available=lambda: (False, "broken"))))]
    )
    with pytest.raises(DriverUnavailableError, match="no storage tier is available on cpu: 'a': broken"):
        plugins.select("tier", None, "cpu")


def test_a_crashing_availability_probe_makes_the_driver_unavailable():
    def probe():
        raise OSError("probe exploded")

    plugins = Plugins(entry_points=False, extra=[("t", TierPlugin(_tier("a", available=probe)))])
    ok, reason = plugins.availability("tier", "a")
    assert not ok and "probe exploded" in reason


def test_wrong_descriptor_type_is_a_plugin_error():
    class Bad:
        @hookimpl
        def slidekit_storage_tiers(self):
            yield OptimizerDescriptor(name="oops", factory=object)

    with pytest.raises(PluginError, match="expected TierDescriptor"):
        Plugins(entry_points=False, extra=[("bad", Bad())]).drivers("tier")


def test_unknown_hook_fails_validation():
    class Typo:
        @hookimpl
        def slidekit_storage_tier(self):  # missing "s"
            return []

    with pytest.raises(PluginError, match="slidekit_storage_tier"):
        Plugins(entry_points=False, extra=[("typo", Typo())])


def test_descriptor_names_and_devices_are_validated():
    with pytest.raises(ValueError, match="not valid"):
        KernelSetDescriptor(name="has space", factory=object)
    with pytest.raises(ValueError, match="unknown device types"):
        KernelSetDescriptor(name="k", factory=object, devices=("tpu",))


def test_listing_covers_every_family():
    rows = Plugins().listing()
    assert {r["family"] for r in rows} >= {"tier", "optimizer", "kernels", "model"}
    assert {r["family"] for r in rows} <= {"tier", "optimizer", "kernels", "model", "lifecycle", "plugin"}
    ram = next(r for r in rows if r["name"] == "ram")
    assert ram["available"] and "host memory" in ram["reason"]


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(UnknownDriverError, match="supported: llama, mistral, qwen2, qwen3"):
        Plugins().adapter_for("gpt2")
