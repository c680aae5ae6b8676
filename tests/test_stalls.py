"""Stuck work ends the run within ``engine.timeout_s``, names the lane and unit, and lets the process exit.

The stuck cases run one after the other in one subprocess with a time limit: each injected call
blocks for ``BLOCK_S`` (1000 s), so a regression shows up as a child that overruns its limit (or
cannot exit, with every stuck thread still there) instead of a pytest run that hangs. The bounds
are generous: ``fit`` must raise no sooner than ``timeout_s`` after the call got stuck (nothing
fails early) and within ``timeout_s + MARGIN_S``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TIMEOUT_S = 3.0  # engine.timeout_s of the child runs
MARGIN_S = 20.0  # on top of timeout_s: steps before the stall, closing, a loaded machine
CHILD_LIMIT_S = 300  # the whole child: imports, model loads, training, four stalls, interpreter exit

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from concurrent.futures import Future

    from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, RunConfig, TrainConfig, Trainer
    from slidekit.errors import PipelineStalled
    from slidekit.hookspecs import hookimpl
    from slidekit.interfaces import OptimizerDescriptor, TierDescriptor
    from slidekit.testing.models import random_batches
    from slidekit_optim.layer_adam import LayerAdam
    from slidekit_tiers.ram import RamTier

    model_dir, run_dir, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    BLOCK_S = 1000.0
    blocked = {}

    def block():
        blocked.setdefault("at", time.monotonic())
        time.sleep(BLOCK_S)

    class StuckAdam(LayerAdam):
        name = "stuck_adam"

        def step(self, *args, **kwargs):  # the first update never returns
            block()

    class StuckReadTier(RamTier):
        name = "stuck_read"

        def map(self, key):  # state is streamed: read on the optimizer lane, chunk by chunk
            return None

        def read(self, key, dst, offset=0):  # a read call that never returns
            block()

    class LostReadTier(RamTier):
        name = "lost_read"

        def read(self, key, dst, offset=0):  # a read whose I/O never completes
            blocked.setdefault("at", time.monotonic())
            return Future()

    class Plugin:
        @hookimpl
        def slidekit_optimizers(self):
            yield OptimizerDescriptor(name="stuck_adam", factory=StuckAdam)

        @hookimpl
        def slidekit_storage_tiers(self):
            yield TierDescriptor(name="stuck_read", factory=StuckReadTier)
            yield TierDescriptor(name="lost_read", factory=LostReadTier)

    SCENARIOS = {
        "optimizer": {},
        "state_read": {"state_tier": "stuck_read"},
        "activation_read": {"activation_tier": "lost_read"},
        "checkpoint": {},
    }
    # One after the other in this process: each leaves a thread stuck for BLOCK_S, and still the
    # interpreter must exit at the end.
    for scenario, engine in SCENARIOS.items():
        blocked.clear()

        def hook(lane):
            if scenario == "checkpoint" and lane == "checkpoint:array":  # the writer thread, final save
                block()

        cfg = TrainConfig(
            model=ModelConfig(source=model_dir),
            optim=OptimConfig(name="stuck_adam" if scenario == "optimizer" else "layer_adam", lr=1e-3),
            engine=EngineConfig(device="cpu", gpu_resident="none", timeout_s=timeout_s, **engine),
            run=RunConfig(dir=run_dir if scenario == "checkpoint" else None),
        )
        trainer = Trainer(cfg, plugins=Plugins(extra=[("stuck", Plugin())]), fault_hook=hook)
        units = len(trainer.spec.units)
        try:
            trainer.fit(random_batches(128, steps=3))
            out = {"error": "fit returned"}
        except PipelineStalled as exc:
            after = time.monotonic() - blocked["at"]
            out = {"after_s": after, "lane": exc.lane, "unit": exc.unit, "message": str(exc)}
        out.update(scenario=scenario, units=units)
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def stuck_runs(tiny_model, tmp_path_factory) -> dict:
    """scenario -> what the child reported (lane, unit, message, seconds from the stuck call to the error)."""
    run_dir = tmp_path_factory.mktemp("stuck") / "run"
    argv = [sys.executable, "-c", _CHILD, str(tiny_model("llama")), str(run_dir), str(TIMEOUT_S)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_LIMIT_S, env=env)
        out, problem = (
            proc.stdout,
            None if proc.returncode == 0 else f"exit status {proc.returncode}: {proc.stderr}",
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        problem = f"the child did not end (a stuck run, or a process that cannot exit) in {CHILD_LIMIT_S} s"
    results = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["scenario"]] = result
    results["problem"] = problem
    return results


def _result(stuck_runs: dict, scenario: str) -> dict:
    assert stuck_runs["problem"] is None, stuck_runs
    result = stuck_runs.get(scenario)
    assert result is not None, f"no result for {scenario}: {stuck_runs}"
    assert "error" not in result, result
    assert TIMEOUT_S <= result["after_s"] < TIMEOUT_S + MARGIN_S, result
    return result


@pytest.mark.slow
def test_a_stuck_optimizer_step_fails_the_run_and_the_process_exits(stuck_runs):
    result = _result(stuck_runs, "optimizer")
    head = result["units"] - 1  # the backward pass hands the head to the optimizer first
    assert (result["lane"], result["unit"]) == ("optim", head), result
    assert f"the optim lane has been running unit {head}" in result["message"]
    assert "engine.timeout_s" in result["message"]


@pytest.mark.slow
def test_a_tier_read_that_never_returns_fails_the_run(stuck_runs):
    result = _result(stuck_runs, "state_read")
    assert (result["lane"], result["unit"]) == ("optim", result["units"] - 1), result


@pytest.mark.slow
def test_a_tier_read_that_never_completes_names_the_read(stuck_runs):
    result = _result(stuck_runs, "activation_read")
    assert result["lane"] == "main", result
    assert "reading the activation" in result["message"], result


@pytest.mark.slow
def test_a_stuck_checkpoint_writer_fails_the_run_and_the_process_exits(stuck_runs):
    result = _result(stuck_runs, "checkpoint")
    assert result["lane"] == "checkpoint", result
    assert "checkpoint step 3" in result["message"], result
