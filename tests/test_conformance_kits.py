"""The conformance kits report a skipped check as a skip, never as a pass (``slidekit.testing.conformance``).

``check_tier`` and ``check_optimizer`` used to pass over a check that raised ``unittest.SkipTest``: a tier
never run against CUDA tensors "passed". Now a skip that is not allowed ends the kit with
``unittest.SkipTest`` (pytest: skipped, with the reason), a check of a capability the driver does not
declare is "not applicable" (no gap), and an allowed skip is still listed in the outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import unittest

import pytest
import torch

from slidekit.interfaces import OptimizerHyper, TierContext
from slidekit.testing import optimizers as opt_kit
from slidekit.testing import tiers as tier_kit
from slidekit.testing.conformance import NotApplicable, run_checks
from slidekit_optim.layer_adam import LayerAdam
from slidekit_tiers.ram import RamTier


def passes(make):
    make()


def needs_a_gadget(make):
    raise unittest.SkipTest("needs a gadget")


def declares_nothing(make):
    raise NotApplicable("the driver declares no such capability")


def breaks(make):
    raise AssertionError("the driver is broken")


def test_a_skip_is_not_a_pass_unless_allowed():
    with pytest.raises(unittest.SkipTest) as info:
        run_checks((passes, needs_a_gadget, declares_nothing), object, driver="tier 'x'")
    said = str(info.value)
    assert said.startswith("tier 'x': 1 check(s) passed, skipped: needs_a_gadget (needs a gadget)")
    assert "not applicable: declares_nothing (the driver declares no such capability)" in said
    assert "A skipped check is not a pass: tier 'x' is not shown to conform" in said

    outcome = run_checks(
        (passes, needs_a_gadget, declares_nothing), object, driver="x", allow_skips=[needs_a_gadget]
    )
    assert outcome.passed == ("passes",) and not outcome.complete
    assert outcome.skipped == {"needs_a_gadget": "needs a gadget"}
    assert outcome.not_applicable == {"declares_nothing": "the driver declares no such capability"}
    whole = run_checks((passes, declares_nothing), object, driver="x")  # nothing missing: complete
    assert whole.complete and whole.passed == ("passes",)


def test_a_failure_wins_over_skips_and_a_bad_allowance_is_refused():
    with pytest.raises(AssertionError, match="the driver is broken"):
        run_checks((needs_a_gadget, breaks, passes), object, driver="x")
    with pytest.raises(ValueError, match=r"allow_skips names \['check_typo'\], which are no checks"):
        run_checks((passes,), object, driver="x", allow_skips=["check_typo"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the device checks run and pass")
def test_the_tier_kit_does_not_pass_a_tier_it_could_not_run_on_a_device():
    def make():
        return RamTier(TierContext(device=torch.device("cpu")))

    with pytest.raises(
        unittest.SkipTest,
        match=r"tier 'ram': 13 check\(s\) passed, skipped: check_device_tensors "
        r"\(needs a CUDA device\)",
    ):
        tier_kit.check_tier(make)
    outcome = tier_kit.check_tier(make, allow_skips=tier_kit.DEVICE_CHECKS)
    assert (
        set(outcome.skipped) == {"check_device_tensors"} and len(outcome.passed) == len(tier_kit.CHECKS) - 1
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the device checks run and pass")
def test_the_optimizer_kit_tells_a_capability_not_declared_from_a_check_not_run():
    declares = LayerAdam(OptimizerHyper(), impl="torch")
    assert declares.device_update is True  # so its device check is skipped here, not inapplicable
    with pytest.raises(unittest.SkipTest, match=r"skipped: check_device_update \(needs a CUDA device\)"):
        opt_kit.check_optimizer(lambda: LayerAdam(OptimizerHyper(), impl="torch"))

    class HostOnly(LayerAdam):
        device_update = False

    outcome = opt_kit.check_optimizer(lambda: HostOnly(OptimizerHyper(), impl="torch"))
    assert outcome.complete and outcome.driver == "optimizer 'layer_adam'"
    assert list(outcome.not_applicable) == ["check_device_update"]
    assert "declares device_update = False" in outcome.not_applicable["check_device_update"]


def test_pytest_reports_a_kit_with_a_skip_as_skipped(tmp_path):
    (tmp_path / "test_kit.py").write_text(
        textwrap.dedent(
            """
            import unittest
            from slidekit.testing.conformance import run_checks

            def needs_a_gadget(make):
                raise unittest.SkipTest("needs a gadget")

            def test_kit():
                run_checks((needs_a_gadget,), object, driver="tier 'x'")
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "test_kit.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a skip fails nothing, and passes nothing
    assert "1 skipped" in proc.stdout and "passed" not in proc.stdout.splitlines()[-1]
    assert "tier 'x': 0 check(s) passed, skipped: needs_a_gadget (needs a gadget)" in proc.stdout
