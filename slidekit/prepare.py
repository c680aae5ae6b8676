"""Ahead-of-time driver preparation, for ``slidekit build``: compile what drivers would build on first use.

A driver takes part by giving its descriptor a ``prepare`` callable
(``slidekit.interfaces.DriverDescriptor.prepare``, returning ``Prepared``);
the bundled ``layer_adam`` and ``adamw_8bit`` compile their fused CPU
kernels there. ``prepare_drivers`` calls it for every such driver of every
family, or for the ones named, and says per driver what happened, how long it
took and where the result lives. The core never imports a plugin: it only
calls what the descriptors offer, so third-party drivers take part alike.

Test: ``pytest tests/test_prepare.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from slidekit.errors import UnknownDriverError
from slidekit.interfaces import Prepared
from slidekit.plugins import FAMILIES, Plugins, Registered

__all__ = ["STATUSES", "Outcome", "prepare_drivers"]

#: ``Outcome.status`` values; "failed" is the only one that makes ``slidekit build`` fail.
STATUSES = ("built", "up to date", "skipped", "failed")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What preparing one driver did."""

    family: str
    name: str
    plugin: str
    status: str  # one of STATUSES
    seconds: float  # spent in prepare() (0 when skipped)
    location: str  # where the result lives; "" when none or failed
    detail: str  # what was prepared, or why it was skipped or failed

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def _candidates(plugins: Plugins, names: Sequence[str]) -> list[tuple[str, Registered]]:
    """(family, driver) pairs to prepare: those with ``prepare``, or every driver with a name asked for."""
    every = [(family, reg) for family in FAMILIES for reg in plugins.drivers(family)]
    if not names:
        return [(f, r) for f, r in every if r.descriptor.prepare is not None]
    unknown = [n for n in dict.fromkeys(names) if all(r.name != n for _, r in every)]
    if unknown:
        able = sorted({r.name for _, r in every if r.descriptor.prepare is not None})
        raise UnknownDriverError(
            f"no driver is named {', '.join(map(repr, unknown))}; drivers with something to build: "
            f"{', '.join(able) or 'none'} (`slidekit plugins` lists every driver)"
        )
    wanted = set(names)
    return [(f, r) for f, r in every if r.name in wanted]


def _prepare(plugins: Plugins, family: str, reg: Registered, explicit: bool) -> Outcome:
    def outcome(status: str, seconds: float = 0.0, location: str = "", detail: str = "") -> Outcome:
        return Outcome(family, reg.name, reg.plugin, status, seconds, location, detail)

    prepare = reg.descriptor.prepare
    if prepare is None:
        return outcome("up to date", detail="nothing to build: the driver needs no preparation")
    ok, reason = plugins.availability(family, reg.name)
    if not ok:  # named explicitly, that is a failure; otherwise there is just nothing to do here
        return outcome("failed" if explicit else "skipped", detail=f"unavailable: {reason}")
    start = time.perf_counter()
    try:
        done = prepare()
    except Exception as exc:  # a third-party driver's failure is reported, not raised
        return outcome("failed", time.perf_counter() - start, detail=str(exc) or repr(exc))
    seconds = time.perf_counter() - start
    if not isinstance(done, Prepared):
        return outcome("failed", seconds, detail=f"prepare() returned {done!r}, not a Prepared")
    return outcome("built" if done.built else "up to date", seconds, done.location, done.detail)


def prepare_drivers(plugins: Plugins, names: Sequence[str] = ()) -> list[Outcome]:
    """Prepare every driver that has something to build, or the drivers ``names`` (of any family).

    Unavailable drivers are skipped with their reason, unless named. A name no
    driver has raises ``UnknownDriverError``; failures are outcomes, not raised.
    """
    return [_prepare(plugins, family, reg, bool(names)) for family, reg in _candidates(plugins, names)]
