"""A broken third-party plugin is named and left out, and everything else still loads and lists; a plugin
with lifecycle hooks only is listed too.

The plugins here come from entry points of a distribution written into a temporary directory on
``sys.path`` (its ``*.dist-info/entry_points.txt``), exactly as an installed one is found.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from slidekit import Plugins
from slidekit.cli import main
from slidekit.errors import PluginError, UnknownDriverError
from slidekit.hookspecs import hookimpl

MODULES = {
    # Fails to import: a dependency it needs is missing.
    "skt_broken": "import skt_no_such_dependency\n",
    # Lifecycle hooks only: a logger.
    "skt_logger": """
        from slidekit.hookspecs import hookimpl

        STEPS = []

        @hookimpl
        def slidekit_step_end(step, metrics):
            STEPS.append(step)

        @hookimpl
        def slidekit_fit_end(steps, error):
            pass
    """,
    # A hook implementation that matches no spec (a typo).
    "skt_typo": """
        from slidekit.hookspecs import hookimpl

        @hookimpl
        def slidekit_storage_tier():
            return []
    """,
    # A driver hook that raises.
    "skt_raises": """
        from slidekit.hookspecs import hookimpl

        @hookimpl
        def slidekit_storage_tiers():
            raise RuntimeError("cannot open /dev/skt0")
    """,
}


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A distribution 'skt-plugins' with one entry point in group slidekit per module of MODULES."""
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    info = tmp_path / "skt_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skt-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[slidekit]\n" + "".join(f"{name} = {name}\n" for name in MODULES))
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates the import caches
    yield
    for name in MODULES:
        sys.modules.pop(name, None)


def _load(**kw) -> Plugins:
    with pytest.warns(RuntimeWarning) as caught:
        plugins = Plugins(**kw)
        plugins.drivers("tier")  # skt_raises fails here, when the tier registry is built
    said = "\n".join(str(w.message) for w in caught)
    for name in ("skt_broken", "skt_typo", "skt_raises"):
        assert f"plugin {name!r} is left out" in said
        assert f"SLIDEKIT_BLOCK_PLUGINS={name}" in said
    return plugins


def test_broken_plugins_are_left_out_named_with_their_error_and_the_rest_load(installed):
    plugins = _load()
    assert plugins.failed["skt_broken"] == (
        "failed to import: ModuleNotFoundError: No module named 'skt_no_such_dependency'"
    )
    assert (
        plugins.failed["skt_typo"].startswith("invalid: ")
        and "slidekit_storage_tier" in plugins.failed["skt_typo"]
    )
    assert plugins.failed["skt_raises"] == (
        "failed in slidekit_storage_tiers(): RuntimeError: cannot open /dev/skt0"
    )
    assert {"ram", "posix", "layer_adam", "torch_ref", "skt_logger"} <= set(plugins.plugin_names())
    assert not {"skt_broken", "skt_typo", "skt_raises"} & set(plugins.plugin_names())
    assert plugins.select("tier", "ram", "cpu").name == "ram"
    with pytest.raises(
        UnknownDriverError,
        match=r"unknown storage tier 'skt0'.*plugin 'skt_raises' was left out "
        r"\(failed in slidekit_storage_tiers\(\): RuntimeError: cannot open /dev/skt0\)",
    ):
        plugins.get("tier", "skt0")


def test_a_blocked_broken_plugin_is_not_even_imported(installed, recwarn):
    plugins = Plugins(block=["skt_broken", "skt_typo", "skt_raises"])
    plugins.drivers("tier")
    assert plugins.failed == {} and not [w for w in recwarn if "left out" in str(w.message)]
    assert "skt_broken" not in sys.modules


def test_the_listing_names_the_broken_and_the_lifecycle_only_plugins(installed):
    rows = {(r["family"], r["name"]): r for r in _load().listing()}
    broken = rows[("plugin", "skt_broken")]
    assert broken["status"] == "failed to import" and not broken["available"]
    assert broken["reason"] == (
        "ModuleNotFoundError: No module named 'skt_no_such_dependency'; block it with "
        "SLIDEKIT_BLOCK_PLUGINS=skt_broken"
    )
    assert rows[("plugin", "skt_typo")]["status"] == "invalid"
    assert rows[("plugin", "skt_raises")]["status"] == "failed in slidekit_storage_tiers()"
    logger = rows[("lifecycle", "skt_logger")]
    assert logger["available"] and logger["reason"] == "hooks: slidekit_fit_end, slidekit_step_end"
    assert ("tier", "ram") in rows and ("model", "llama") in rows  # the rest is listed as ever


def test_slidekit_plugins_lists_them_and_the_rest(installed, capsys):
    assert main(["plugins"]) == 0
    out, err = capsys.readouterr()
    lines = {ln.split()[1]: ln for ln in out.splitlines()[1:]}
    assert lines["skt_broken"].split()[:4] == ["plugin", "skt_broken", "skt_broken", "failed"]
    assert "failed to import" in lines["skt_broken"]
    assert "No module named 'skt_no_such_dependency'" in lines["skt_broken"]
    assert lines["skt_logger"].split()[0] == "lifecycle" and "hooks: slidekit_fit_end" in lines["skt_logger"]
    for name in ("ram", "posix", "layer_adam", "adamw_8bit", "torch_ref", "llama", "qwen3"):
        assert name in lines, name
    assert "left out" not in err  # said once, in the table


def test_a_lifecycle_only_plugin_registered_in_code_is_listed_and_a_broken_one_is_an_error():
    class Logger:
        @hookimpl
        def slidekit_fit_start(self, config, drivers):
            pass

    rows = Plugins(entry_points=False, extra=[("my_logger", Logger())]).listing()
    assert [r for r in rows if r["family"] == "lifecycle"] == [
        {
            "family": "lifecycle",
            "name": "my_logger",
            "plugin": "my_logger",
            "status": "available",
            "available": True,
            "reason": "hooks: slidekit_fit_start",
            "priority": None,
            "devices": "",
            "description": "",
            "options": {},
        }
    ]

    class Raises:  # registered by the caller's own code: its mistake stops it, loudly
        @hookimpl
        def slidekit_storage_tiers(self):
            raise RuntimeError("boom")

    with pytest.raises(PluginError, match=r"plugin 'raises' failed in slidekit_storage_tiers\(\)"):
        Plugins(entry_points=False, extra=[("raises", Raises())]).drivers("tier")
