"""Running a conformance suite: a skipped check is not a pass.

``run_checks(checks, make, driver=...)`` runs every check of a suite
(``slidekit.testing.tiers.CHECKS``, ``slidekit.testing.optimizers.CHECKS``)
against fresh drivers from ``make`` and returns a ``Conformance`` saying
which passed, which were skipped and why, and which do not apply. A check
raises:

* ``AssertionError``: the driver does not conform; it propagates at once;
* ``NotApplicable``: it tests a capability the driver does not declare (an
  optimizer with ``device_update = False`` is not run on the GPU). Nothing is
  missing: the driver never claimed it;
* ``unittest.SkipTest``: this machine cannot run it (no CUDA device). The
  driver was *not* shown to conform. Unless that check is named in
  ``allow_skips``, ``run_checks`` raises ``unittest.SkipTest`` once every
  check has run, listing what was skipped and why and how many passed: pytest
  reports the test as skipped with that reason, never as passed, and any
  other caller gets an exception instead of a silent pass.

A CPU-only CI that means to accept the device checks' skips says so
(``allow_skips=DEVICE_CHECKS``) and gets the ``Conformance`` back, whose
``skipped`` still lists them; on a machine that can run them they run.

Test: ``pytest tests/test_conformance_kits.py``.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Conformance", "NotApplicable", "run_checks"]

D = TypeVar("D")


class NotApplicable(unittest.SkipTest):
    """A check of a capability the driver does not declare: not required of it, so no gap.

    A ``unittest.SkipTest``, so that pytest reports a check run on its own as skipped.
    """


@dataclass(frozen=True, slots=True)
class Conformance:
    """What a suite found: checks passed, checks skipped (name -> why), checks that do not apply."""

    driver: str
    passed: tuple[str, ...]
    skipped: Mapping[str, str] = field(default_factory=dict)  # this machine could not run them
    not_applicable: Mapping[str, str] = field(default_factory=dict)  # capabilities not declared

    @property
    def complete(self) -> bool:
        """Whether every check that applies ran and passed (nothing was skipped)."""
        return not self.skipped

    def summary(self) -> str:
        """One line: how many passed, what was skipped and why, what does not apply."""
        parts = [f"{self.driver}: {len(self.passed)} check(s) passed"]
        if self.skipped:
            parts.append("skipped: " + "; ".join(f"{k} ({v})" for k, v in self.skipped.items()))
        if self.not_applicable:
            parts.append("not applicable: " + "; ".join(f"{k} ({v})" for k, v in self.not_applicable.items()))
        return ", ".join(parts)


def _check_name(check: Callable[..., Any] | str) -> str:
    return check if isinstance(check, str) else check.__name__


def run_checks(
    checks: Sequence[Callable[[Callable[[], D]], None]],
    make: Callable[[], D],
    *,
    driver: str | Callable[[], str],
    allow_skips: Collection[Callable[..., Any] | str] = (),
) -> Conformance:
    """Run ``checks`` against ``make``; the ``Conformance``, or ``unittest.SkipTest`` on a skip not allowed.

    ``driver`` names the driver in the outcome ("tier 'ram'"), or says it once the checks have run (from
    a driver they built). ``allow_skips``: checks (or their names)
    that may be skipped on this machine without raising. An ``AssertionError`` (or any other error) of a
    check propagates at once. A name in ``allow_skips`` that is no check of the suite is a ValueError.
    """
    names = {c.__name__ for c in checks}
    allowed = {_check_name(c) for c in allow_skips}
    if allowed - names:
        raise ValueError(
            f"allow_skips names {sorted(allowed - names)}, which are no checks of this suite; "
            f"its checks: {', '.join(c.__name__ for c in checks)}"
        )
    passed: list[str] = []
    skipped: dict[str, str] = {}
    not_applicable: dict[str, str] = {}
    for check in checks:
        try:
            check(make)
        except NotApplicable as exc:
            not_applicable[check.__name__] = str(exc)
        except unittest.SkipTest as exc:
            skipped[check.__name__] = str(exc)
        else:
            passed.append(check.__name__)
    outcome = Conformance(
        driver if isinstance(driver, str) else driver(), tuple(passed), skipped, not_applicable
    )
    refused = sorted(set(skipped) - allowed)
    if refused:
        raise unittest.SkipTest(
            f"{outcome.summary()}. A skipped check is not a pass: {outcome.driver} is not shown to conform. Run the "
            f"suite where {', '.join(refused)} can run, or pass allow_skips=[...] to accept the skip here"
        )
    return outcome
