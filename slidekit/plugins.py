"""The plugin manager: load plugins, validate them, index their drivers, select by name.

Plugins come from the entry-point group ``slidekit`` (every bundled plugin is
registered that way, exactly as a third party's would be), plus the core's own
model adapters. ``Plugins`` wraps a fresh ``pluggy.PluginManager``:

* entry-point loading can be switched off (``entry_points=False`` or
  ``SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD=1``) or narrowed to named plugins;
* plugins can be blocked by name (``block=`` or ``SLIDEKIT_BLOCK_PLUGINS=a,b``);
* ``check_pending`` rejects hook implementations that match no spec;
* two drivers of one family under one name are an error naming both plugins;
* ``select(family, name)`` builds nothing: it returns the descriptor. An
  explicit name must exist and be available, or the error gives the reason
  and the alternatives; "auto" takes the best available driver by priority and
  says what it chose and why.

Test: ``pytest tests/test_plugins.py``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Final

import pluggy

from slidekit import hookspecs
from slidekit.errors import (
    DriverUnavailableError,
    DuplicateDriverError,
    PluginError,
    UnknownDriverError,
)
from slidekit.interfaces import (
    Availability,
    DriverDescriptor,
    KernelSetDescriptor,
    ModelAdapterDescriptor,
    OptimizerDescriptor,
    TierDescriptor,
)

__all__ = [
    "ENV_BLOCK",
    "ENV_NO_AUTOLOAD",
    "FAMILIES",
    "Plugins",
    "Registered",
    "Selection",
]

ENV_BLOCK: Final = "SLIDEKIT_BLOCK_PLUGINS"
ENV_NO_AUTOLOAD: Final = "SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD"
CORE_MODELS_PLUGIN: Final = "slidekit.models"


@dataclass(frozen=True, slots=True)
class _Family:
    hook: str
    descriptor: type[DriverDescriptor]
    noun: str


#: family name -> the hook that yields its descriptors and the descriptor type.
FAMILIES: Final[dict[str, _Family]] = {
    "tier": _Family("slidekit_storage_tiers", TierDescriptor, "storage tier"),
    "optimizer": _Family("slidekit_optimizers", OptimizerDescriptor, "optimizer"),
    "kernels": _Family("slidekit_kernel_sets", KernelSetDescriptor, "kernel set"),
    "model": _Family("slidekit_model_adapters", ModelAdapterDescriptor, "model adapter"),
}


@dataclass(frozen=True, slots=True)
class Registered:
    """A descriptor and the plugin that offered it."""

    descriptor: Any
    plugin: str

    @property
    def name(self) -> str:
        return str(self.descriptor.name)


@dataclass(frozen=True, slots=True)
class Selection:
    """The outcome of ``Plugins.select``: which driver, and a sentence saying why."""

    registered: Registered
    reason: str
    automatic: bool

    @property
    def descriptor(self) -> Any:
        return self.registered.descriptor

    @property
    def name(self) -> str:
        return self.registered.name


def _env_list(var: str) -> set[str]:
    return {p.strip() for p in os.environ.get(var, "").split(",") if p.strip()}


class Plugins:
    """A fresh plugin manager with its driver registries.

    Args:
        entry_points: True loads every plugin in group ``slidekit``; False none;
            a collection of names loads only those. The environment variable
            ``SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD=1`` turns True into False.
        block: plugin names (entry-point names, or "slidekit.models") never loaded.
            Added to the names in ``SLIDEKIT_BLOCK_PLUGINS``.
        extra: plugin objects (modules, instances) to register directly, for
            tests and embedding applications: ``(name, plugin)`` pairs.
    """

    def __init__(
        self,
        *,
        entry_points: bool | Collection[str] = True,
        block: Iterable[str] = (),
        extra: Iterable[tuple[str, object]] = (),
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.blocked = frozenset(set(block) | _env_list(ENV_BLOCK))
        for name in self.blocked:
            self.pm.set_blocked(name)
        if CORE_MODELS_PLUGIN not in self.blocked:
            from slidekit.models import adapters

            self.pm.register(adapters, name=CORE_MODELS_PLUGIN)
        if entry_points is True and os.environ.get(ENV_NO_AUTOLOAD, "") not in ("", "0"):
            entry_points = False
        self._load_entry_points(entry_points)
        for name, plugin in extra:
            if name not in self.blocked:
                self.pm.register(plugin, name=name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{exc}; hook implementations must match a spec in slidekit.hookspecs") from exc
        self._registries: dict[str, dict[str, Registered]] = {}
        self._availability: dict[tuple[str, str], Availability] = {}

    def _load_entry_points(self, entry_points: bool | Collection[str]) -> None:
        if entry_points is False:
            return
        names: Collection[str | None] = [None] if entry_points is True else list(entry_points)
        for name in names:
            try:
                self.pm.load_setuptools_entrypoints(hookspecs.PROJECT, name=name)
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"plugin {exc.plugin!r} is invalid: {exc}") from exc
            except Exception as exc:  # an import error inside a third-party plugin
                raise PluginError(
                    f"loading entry points of group {hookspecs.PROJECT!r} failed: {exc!r}; "
                    f"block the offending plugin with {ENV_BLOCK}=NAME to run without it"
                ) from exc

    # ------------------------------------------------------------------ registries

    def plugin_names(self) -> list[str]:
        """Names of the registered plugins, sorted."""
        return sorted(n for n, p in self.pm.list_name_plugin() if p is not None)

    def drivers(self, family: str) -> list[Registered]:
        """Every driver of a family, best priority first, then by name."""
        return sorted(self._registry(family).values(), key=lambda r: (-r.descriptor.priority, r.name))

    def _registry(self, family: str) -> dict[str, Registered]:
        if family not in FAMILIES:
            raise UnknownDriverError(f"unknown driver family {family!r}; families: {', '.join(FAMILIES)}")
        if family not in self._registries:
            self._registries[family] = self._collect(FAMILIES[family])
        return self._registries[family]

    def _collect(self, fam: _Family) -> dict[str, Registered]:
        found: dict[str, Registered] = {}
        hook = getattr(self.pm.hook, fam.hook)
        for impl in hook.get_hookimpls():
            try:
                offered = list(impl.function() or ())
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name!r} failed in {fam.hook}(): {exc!r}") from exc
            for desc in offered:
                if not isinstance(desc, fam.descriptor):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} yielded {desc!r} from {fam.hook}(); "
                        f"expected {fam.descriptor.__name__}"
                    )
                if desc.name in found:
                    raise DuplicateDriverError(
                        f"two {fam.noun}s are named {desc.name!r}: one from plugin "
                        f"{found[desc.name].plugin!r}, one from plugin {impl.plugin_name!r}; "
                        f"block one of them ({ENV_BLOCK}=NAME or block=[...])"
                    )
                found[desc.name] = Registered(desc, impl.plugin_name)
        return found

    def availability(self, family: str, name: str) -> Availability:
        """``(ok, reason)`` for one driver, probed once and cached."""
        key = (family, name)
        if key not in self._availability:
            reg = self.get(family, name)
            try:
                ok, reason = reg.descriptor.available()
            except Exception as exc:  # a broken probe makes the driver unavailable, not the run
                ok, reason = False, f"its availability check raised {exc!r}"
            self._availability[key] = (bool(ok), str(reason))
        return self._availability[key]

    def get(self, family: str, name: str) -> Registered:
        """The driver of that family and name, or an error listing the names there are."""
        reg = self._registry(family)
        if name not in reg:
            noun = FAMILIES[family].noun
            choices = ", ".join(sorted(reg)) or "none (is slidekit installed, or are plugins blocked?)"
            blocked = f"; blocked plugins: {', '.join(sorted(self.blocked))}" if self.blocked else ""
            raise UnknownDriverError(f"unknown {noun} {name!r}; choose one of: {choices}{blocked}")
        return reg[name]

    # ------------------------------------------------------------------ selection

    def select(self, family: str, name: str | None, device_type: str) -> Selection:
        """Pick a driver for ``device_type`` ("cpu", "cuda", "rocm").

        An explicit ``name`` must exist, serve the device and be available, or
        this raises with the reason and the available alternatives. ``None`` or
        "auto" takes the available driver with the highest priority.
        """
        noun = FAMILIES[family].noun
        if name in (None, "auto"):
            return self._select_auto(family, noun, device_type)
        reg = self.get(family, name)
        if device_type not in reg.descriptor.devices:
            raise DriverUnavailableError(
                f"{noun} {name!r} does not run on {device_type} (it serves "
                f"{', '.join(reg.descriptor.devices)}); {self._alternatives(family, device_type, name)}"
            )
        ok, reason = self.availability(family, name)
        if not ok:
            raise DriverUnavailableError(
                f"{noun} {name!r} is unavailable: {reason}; {self._alternatives(family, device_type, name)}"
            )
        return Selection(reg, f"{noun} {name!r} as configured ({reason})", automatic=False)

    def _select_auto(self, family: str, noun: str, device_type: str) -> Selection:
        skipped: list[str] = []
        for reg in self.drivers(family):
            if device_type not in reg.descriptor.devices:
                continue
            ok, reason = self.availability(family, reg.name)
            if ok:
                why = f"auto-selected {noun} {reg.name!r} (priority {reg.descriptor.priority}, {reason})"
                if skipped:
                    why += "; skipped " + "; ".join(skipped)
                return Selection(reg, why, automatic=True)
            skipped.append(f"{reg.name!r}: {reason}")
        detail = "; ".join(skipped) or "no plugin offers one for this device"
        raise DriverUnavailableError(f"no {noun} is available on {device_type}: {detail}")

    def _alternatives(self, family: str, device_type: str, exclude: str) -> str:
        alts = [
            r.name
            for r in self.drivers(family)
            if r.name != exclude
            and device_type in r.descriptor.devices
            and self.availability(family, r.name)[0]
        ]
        return f"available alternatives: {', '.join(alts)}" if alts else "no alternative is available here"

    # ------------------------------------------------------------------ listing

    def listing(self) -> list[dict[str, Any]]:
        """One row per driver of every family, for ``slidekit plugins``."""
        rows = []
        for family in FAMILIES:
            for reg in self.drivers(family):
                ok, reason = self.availability(family, reg.name)
                rows.append(
                    {
                        "family": family,
                        "name": reg.name,
                        "plugin": reg.plugin,
                        "available": ok,
                        "reason": reason,
                        "priority": reg.descriptor.priority,
                        "devices": ",".join(reg.descriptor.devices),
                        "description": reg.descriptor.description,
                    }
                )
        return rows

    def adapter_for(self, model_type: str) -> Registered:
        """The model adapter serving a Hugging Face ``model_type``, or an error listing the supported ones."""
        supported: dict[str, str] = {}
        for reg in self.drivers("model"):
            for mt in reg.descriptor.model_types:
                supported.setdefault(mt, reg.name)
                if mt == model_type:
                    return reg
        raise UnknownDriverError(
            f"no model adapter supports model_type {model_type!r}; supported: "
            f"{', '.join(sorted(supported)) or 'none'}. A plugin can add one through slidekit_model_adapters()"
        )

    # ------------------------------------------------------------------ lifecycle

    @property
    def hook(self) -> Any:
        """The hook relay, for lifecycle calls: ``plugins.hook.slidekit_step_end(...)``."""
        return self.pm.hook
