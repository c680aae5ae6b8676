"""Ahead-of-time preparation (``slidekit build``): through the descriptors only, so third-party drivers take part.

Test plugins are registered through ``Plugins(extra=...)``; the bundled
optimizers' ``prepare`` compiles real kernels and is covered by
``tests/test_cli.py`` and ``tests/plugins/test_build_lock.py``.
"""

from __future__ import annotations

import pytest

from slidekit import Plugins
from slidekit.errors import UnknownDriverError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSetDescriptor, OptimizerDescriptor, Prepared
from slidekit.prepare import prepare_drivers


class ThirdParty:
    """Optimizers that prepare fine, fail, are unavailable, return garbage, or have nothing to prepare."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _prepare(self, name: str, result: object):
        def prepare():
            self.calls.append(name)
            if isinstance(result, Exception):
                raise result
            return result

        return prepare

    @hookimpl
    def slidekit_optimizers(self):
        yield OptimizerDescriptor(
            name="fresh",
            factory=object,
            prepare=self._prepare("fresh", Prepared(built=True, location="/x.so")),
        )
        yield OptimizerDescriptor(
            name="cached", factory=object, prepare=self._prepare("cached", Prepared(built=False, detail="ok"))
        )
        yield OptimizerDescriptor(
            name="broken", factory=object, prepare=self._prepare("broken", RuntimeError("no compiler here"))
        )
        yield OptimizerDescriptor(
            name="elsewhere",
            factory=object,
            available=lambda: (False, "needs a TPU"),
            prepare=self._prepare("elsewhere", Prepared(built=True)),
        )
        yield OptimizerDescriptor(name="odd", factory=object, prepare=self._prepare("odd", "done"))
        yield OptimizerDescriptor(name="plain", factory=object)

    @hookimpl
    def slidekit_kernel_sets(self):
        yield KernelSetDescriptor(
            name="jit", factory=object, prepare=self._prepare("jit", Prepared(built=True))
        )


@pytest.fixture
def third_party():
    plugin = ThirdParty()
    return plugin, Plugins(entry_points=False, extra=[("third_party", plugin)])


def _by_name(outcomes):
    return {o.name: o for o in outcomes}


def test_every_driver_with_something_to_build_is_prepared(third_party):
    plugin, plugins = third_party
    got = _by_name(prepare_drivers(plugins))
    assert set(got) == {"fresh", "cached", "broken", "elsewhere", "odd", "jit"}  # not "plain"
    assert (got["fresh"].status, got["fresh"].location, got["fresh"].plugin) == (
        "built",
        "/x.so",
        "third_party",
    )
    assert (got["cached"].status, got["cached"].detail) == ("up to date", "ok")
    assert (got["broken"].status, got["broken"].detail) == ("failed", "no compiler here")
    assert got["elsewhere"].status == "skipped" and "needs a TPU" in got["elsewhere"].detail
    assert got["odd"].failed and "not a Prepared" in got["odd"].detail
    assert got["jit"].family == "kernels" and got["jit"].status == "built"
    assert "elsewhere" not in plugin.calls  # an unavailable driver is never asked to prepare
    assert all(o.seconds >= 0 for o in got.values())


def test_named_drivers_only_and_a_named_unavailable_one_fails(third_party):
    plugin, plugins = third_party
    got = _by_name(prepare_drivers(plugins, ["cached", "elsewhere", "plain"]))
    assert set(got) == {"cached", "elsewhere", "plain"}
    assert got["elsewhere"].failed and "needs a TPU" in got["elsewhere"].detail
    assert got["plain"].status == "up to date" and "nothing to build" in got["plain"].detail
    assert plugin.calls == ["cached"]


def test_an_unknown_name_lists_what_can_be_built(third_party):
    _, plugins = third_party
    with pytest.raises(UnknownDriverError, match=r"'nope'.*something to build: broken, cached, elsewhere"):
        prepare_drivers(plugins, ["cached", "nope"])


def test_prepare_must_be_callable():
    with pytest.raises(TypeError, match="prepare must be callable"):
        OptimizerDescriptor(name="x", factory=object, prepare="build it")  # type: ignore[arg-type]
