"""The plugin manager: load plugins, validate them, index their drivers, select by name.

Plugins come from the entry-point group ``slidekit`` (every bundled plugin is
registered that way, exactly as a third party's would be), plus the core's own
model adapters. ``Plugins`` wraps a fresh ``pluggy.PluginManager``:

* entry-point loading can be switched off (``entry_points=False`` or
  ``SLIDEKIT_DISABLE_PLUGIN_AUTOLOAD=1``) or narrowed to named plugins;
* plugins can be blocked by name (``block=`` or ``SLIDEKIT_BLOCK_PLUGINS=a,b``);
* ``check_pending`` rejects hook implementations that match no spec;
* a plugin from an entry point that fails to import, is invalid, or raises in
  a driver hook is left out, with a warning naming it and the error, and is
  listed (``failed``, ``listing``); an explicit choice of one of its drivers
  names it. Plugins registered through ``extra`` fail loudly instead;
* two drivers of one family under one name are an error naming both plugins;
* ``select(family, name)`` builds nothing: it returns the descriptor. An
  explicit name must exist and be available, or the error gives the reason
  and the alternatives; "auto" takes the best available driver by priority and
  says what it chose and why;
* ``driver_options`` gives a driver the settings configured for it
  (``plugins.options``), refusing keys its descriptor does not declare, and
  ``Plugins.check_options`` refuses settings for a driver that does not exist.

Test: ``pytest tests/test_plugins.py tests/test_plugin_settings.py tests/test_plugin_failures.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import tomllib
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import pluggy

from slidekit import hookspecs
from slidekit.errors import (
    ConfigError,
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
    "LIFECYCLE",
    "Plugins",
    "Registered",
    "Selection",
    "build_kernel_set",
    "driver_options",
    "family_of",
    "parse_plugin_option",
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
#: The ``listing`` family of a plugin's lifecycle hooks (every hook that yields no drivers).
LIFECYCLE: Final = "lifecycle"
_DRIVER_HOOKS: Final = frozenset(f.hook for f in FAMILIES.values())


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
        #: plugin name -> why it was left out ("failed to import: ...", "invalid: ...", "failed in ...").
        self.failed: dict[str, str] = {}
        self._from_entry_points: set[str] = set()
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
        self._check_pending()
        self._registries: dict[str, dict[str, Registered]] = {}
        self._availability: dict[tuple[str, str], Availability] = {}

    def _load_entry_points(self, entry_points: bool | Collection[str]) -> None:
        """Import and register the plugins of group ``slidekit``, one by one: one that fails is left out."""
        if entry_points is False:
            return
        wanted = None if entry_points is True else set(entry_points)
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            if (wanted is not None and ep.name not in wanted) or self.pm.has_plugin(ep.name):
                continue  # a second distribution's plugin of that name is passed over, as pluggy does
            if self.pm.is_blocked(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # an import error inside a third-party plugin
                self._leave_out(ep.name, f"failed to import: {type(exc).__name__}: {exc}")
                continue
            try:
                self.pm.register(plugin, name=ep.name)
            except pluggy.PluginValidationError as exc:
                self._leave_out(ep.name, f"invalid: {exc}")
                continue
            self._from_entry_points.add(ep.name)

    def _check_pending(self) -> None:
        """Refuse hook implementations that match no spec: an entry point's plugin is left out, an
        ``extra`` one is an error."""
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.pm.get_name(exc.plugin)
                if name not in self._from_entry_points:
                    raise PluginError(
                        f"{exc}; hook implementations must match a spec in slidekit.hookspecs"
                    ) from exc
                self.pm.unregister(exc.plugin)
                self._leave_out(
                    name, f"invalid: {exc}; hook implementations must match a spec in slidekit.hookspecs"
                )

    def _leave_out(self, name: str, why: str) -> None:
        self.failed[name] = why
        warnings.warn(
            f"plugin {name!r} is left out: {why}. Fix or uninstall it, or block it ({ENV_BLOCK}={name}) "
            "to silence this",
            RuntimeWarning,
            stacklevel=4,
        )

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
                if impl.plugin_name not in self._from_entry_points:
                    raise PluginError(f"plugin {impl.plugin_name!r} failed in {fam.hook}(): {exc!r}") from exc
                self._leave_out(impl.plugin_name, f"failed in {fam.hook}(): {type(exc).__name__}: {exc}")
                self._drop(impl.plugin_name)
                continue
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

    def _drop(self, plugin: str) -> None:
        """Unregister a plugin left out after loading, with the drivers it gave families collected so far."""
        self.pm.unregister(name=plugin)
        for registry in self._registries.values():
            for name in [n for n, r in registry.items() if r.plugin == plugin]:
                del registry[name]

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
            failed = "".join(f"; plugin {p!r} was left out ({why})" for p, why in sorted(self.failed.items()))
            raise UnknownDriverError(f"unknown {noun} {name!r}; choose one of: {choices}{blocked}{failed}")
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
        """One row per driver of every family, for ``slidekit plugins``; then one per plugin with
        lifecycle hooks (family "lifecycle", its hooks as the reason), and one per plugin left out
        (family "plugin", status "failed to import", "invalid" or "failed in <hook>()").

        Every row has ``family``, ``name``, ``plugin``, ``status``, ``available``, ``reason``,
        ``priority`` (None where it means nothing), ``devices``, ``description`` and ``options``
        (the settings a driver declares, name -> description).
        """
        rows = []
        for family in FAMILIES:
            for reg in self.drivers(family):
                ok, reason = self.availability(family, reg.name)
                rows.append(
                    {
                        "family": family,
                        "name": reg.name,
                        "plugin": reg.plugin,
                        "status": "available" if ok else "unavailable",
                        "available": ok,
                        "reason": reason,
                        "priority": reg.descriptor.priority,
                        "devices": ",".join(reg.descriptor.devices),
                        "description": reg.descriptor.description,
                        "options": dict(reg.descriptor.options),
                    }
                )
        for name, plugin in sorted(self.pm.list_name_plugin(), key=lambda np: np[0]):
            if plugin is None:  # blocked
                continue
            hooks = sorted(
                h.name for h in self.pm.get_hookcallers(plugin) or () if h.name not in _DRIVER_HOOKS
            )
            if hooks:
                rows.append(_plugin_row(LIFECYCLE, name, "available", "hooks: " + ", ".join(hooks)))
        for name, why in sorted(self.failed.items()):
            status, _, detail = why.partition(": ")
            rows.append(_plugin_row("plugin", name, status, f"{detail}; block it with {ENV_BLOCK}={name}"))
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

    # ------------------------------------------------------------------ settings

    def check_options(self, configured: Mapping[str, Mapping[str, Any]]) -> None:
        """ConfigError unless every name in ``configured`` (``plugins.options``) is a driver here, and every
        key configured for it one that the driver declares (``driver_options``), whether a run uses it or not."""
        drivers: dict[str, list[Registered]] = {}
        for family in FAMILIES:
            for reg in self.drivers(family):
                drivers.setdefault(reg.name, []).append(reg)
        unknown = sorted(set(configured) - set(drivers))
        if unknown:
            failed = "".join(f"; plugin {p!r} was left out ({why})" for p, why in sorted(self.failed.items()))
            raise ConfigError(
                f"plugins.options has settings for {', '.join(map(repr, unknown))}, but no driver is called "
                f"that; drivers: {', '.join(sorted(drivers))}{failed}"
            )
        for name, table in configured.items():
            # Drivers of two families may share a name: a key is fine if one of them declares it.
            if not any(set(table) <= set(r.descriptor.options) for r in drivers[name]):
                driver_options(drivers[name][0], configured)


def _plugin_row(family: str, name: str, status: str, reason: str) -> dict[str, Any]:
    return {
        "family": family,
        "name": name,
        "plugin": name,
        "status": status,
        "available": status == "available",
        "reason": reason,
        "priority": None,
        "devices": "",
        "description": "",
        "options": {},
    }


def family_of(descriptor: Any) -> str:
    """The family ("tier", "optimizer", "kernels", "model") of a descriptor."""
    for family, fam in FAMILIES.items():
        if isinstance(descriptor, fam.descriptor):
            return family
    raise TypeError(
        f"{descriptor!r} is no driver descriptor ({', '.join(f.descriptor.__name__ for f in FAMILIES.values())})"
    )


def driver_options(
    driver: Selection | Registered, configured: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The settings ``configured`` (``plugins.options``) holds for ``driver``: a copy, {} when none.

    A key the driver's descriptor does not declare (``DriverDescriptor.options``) is a ConfigError naming
    the driver, its plugin, the keys and the ones it takes. Values are the driver's to check.
    """
    reg = driver.registered if isinstance(driver, Selection) else driver
    given = dict(configured.get(reg.name, {}))
    declared = reg.descriptor.options
    unknown = sorted(set(given) - set(declared))
    if unknown:
        noun = FAMILIES[family_of(reg.descriptor)].noun
        takes = (
            "it takes " + "; ".join(f"{k} ({v})" for k, v in sorted(declared.items()))
            if declared
            else "it takes no settings"
        )
        raise ConfigError(
            f"plugins.options.{reg.name}: {noun} {reg.name!r} (plugin {reg.plugin!r}) has no setting "
            f"{', '.join(map(repr, unknown))}; {takes}"
        )
    return given


def build_kernel_set(selection: Selection, configured: Mapping[str, Mapping[str, Any]]) -> Any:
    """The selected kernel set: ``factory(options)`` when its descriptor declares settings, else ``factory()``."""
    desc = selection.descriptor
    if desc.options:
        return desc.factory(driver_options(selection, configured))
    driver_options(selection, configured)  # refuses settings for a kernel set that takes none
    return desc.factory()


def parse_plugin_option(text: str) -> tuple[str, str, Any]:
    """``"DRIVER.KEY=VALUE"`` (CLI ``--plugin-option``) as (driver, key, value).

    VALUE is read as a TOML value where it is one (``8``, ``2.5``, ``true``, ``"a b"``, ``[1, 2]``) and
    taken as a string otherwise (``fast``, ``/mnt/nvme``).
    """
    target, eq, raw = text.partition("=")
    driver, dot, key = target.strip().partition(".")
    if not eq or not dot or not driver or not key.strip():
        raise ConfigError(f"--plugin-option takes DRIVER.KEY=VALUE (e.g. posix.queue_depth=8), got {text!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return driver, key.strip(), value
