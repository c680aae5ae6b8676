"""Ratchet: the hook names and signatures are public API. Specs may only gain arguments.

If this test fails because you ADDED an argument, extend the table. If it
fails because one was removed or renamed, that breaks third-party plugins.
"""

from __future__ import annotations

import inspect

from slidekit import hookspecs

PINNED = {
    "slidekit_storage_tiers": [],
    "slidekit_optimizers": [],
    "slidekit_kernel_sets": [],
    "slidekit_model_adapters": [],
    "slidekit_fit_start": ["config", "drivers", "steps_done"],
    "slidekit_step_end": ["step", "metrics"],
    "slidekit_evaluate": ["step", "metrics"],
    "slidekit_checkpoint_saved": ["step", "path"],
    "slidekit_fit_end": ["steps", "error"],
}


def _specs() -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if name.startswith("slidekit_") and callable(fn)
    }


def test_hook_names_are_pinned():
    assert set(_specs()) == set(PINNED)


def test_hook_signatures_only_grow():
    for name, params in _specs().items():
        assert params[: len(PINNED[name])] == PINNED[name], f"{name} changed its arguments: {params}"
        assert params == PINNED[name], f"{name} gained arguments {params}: add them to PINNED"


def test_no_spec_is_firstresult():
    # Descriptor hooks must collect from every plugin; lifecycle hooks notify all.
    for name in PINNED:
        opts = getattr(hookspecs, name).slidekit_spec
        assert not opts.get("firstresult"), name
