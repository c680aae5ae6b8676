"""`slidekit bench` on several GPUs (issue 19): the data-parallel suites, a real 2-rank run, the table.

The real run starts ``python -m torch.distributed.run --nproc-per-node 2 -m slidekit.tools.bench`` on
the CPU (gloo) through the runner's own launch code (``run_suite``) and checks that rank 0 alone
prints, with every rank's figures and every rank's tokens. The rest checks the pieces: what the dp
suites expand to (GPUs, flags, environment, importance, one call), the costs of runs on N GPUs, the
table's scaling arithmetic on hand-made records, and that a deadline kills a child's whole tree
(torchrun's ranks run in sessions of their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from slidekit.cli import build_parser
from slidekit.tools.bench.costs import RANK_SETUP_S, RANK_STEP_FACTOR, TORCHRUN_S, cost_of, predict
from slidekit.tools.bench.runner import MULTICAST_OFF, Recorder, _command, child_env, run_suite
from slidekit.tools.bench.suite_presets import SUITES
from slidekit.tools.bench.suites import Mode, Suite, expand
from slidekit.tools.bench.summary import cells, dp_table, scaling, suite_markdown
from slidekit.tools.bench.timeplan import make_plan
from slidekit.tools.children import process_tree, stream_child

LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _args(*extra: str):
    return build_parser().parse_args(["bench", "--device", "cpu", *extra])


def test_the_dp_suites_run_each_mode_on_one_and_two_gpus_and_deepspeed_on_two():
    for name, model in (("dp-qwen2.5-7b", "qwen2.5-7b"), ("dp-qwen2.5-14b", "qwen2.5-14b")):
        suite = SUITES[name]
        first = [r for r in expand(suite) if r.repeat == 1]
        got = {(r.system, r.resident, r.ranks) for r in first}
        assert got == {
            ("slidekit", "auto", 1),
            ("slidekit", "auto", 2),
            ("slidekit", "none", 1),
            ("slidekit", "none", 2),
            ("deepspeed", None, 2),
        }
        assert {r.batches for r in expand(suite)} == {(8,)} and {r.clip for r in first} == {None}
        two = next(r for r in first if r.resident == "none" and r.ranks == 2)
        assert two.label == "slidekit (resident none) on 2 GPUs" and two.family == "slidekit (resident none)"
        assert two.cost_key == "slidekit:none@2"
        cmd = _command(_args(), two, suite)
        assert cmd[: len(LAUNCH)] == LAUNCH and cmd[len(LAUNCH) : len(LAUNCH) + 2] == [
            "-m",
            "slidekit.tools.bench",
        ]
        assert cmd[cmd.index("--model") + 1] == model and cmd[cmd.index("--resident") + 1] == "none"
        ds = next(r for r in first if r.system == "deepspeed")
        assert ds.label == "DeepSpeed ZeRO-2 Offload on 2 GPUs" and ds.cost_key == "deepspeed@2"
        cmd = _command(_args(), ds, suite)
        assert cmd[: len(LAUNCH)] == LAUNCH and "slidekit.tools.baselines.deepspeed_offload" in cmd
        one = next(r for r in first if r.resident == "auto" and r.ranks == 1)
        assert _command(_args(), one, suite)[:3] == [sys.executable, "-m", "slidekit.tools.bench"]
    # 7B: every run of the first repeat is core (importance 0); 14B: the planner's choice first, DeepSpeed last.
    seven = {(r.resident, r.ranks): r.importance for r in expand(SUITES["dp-qwen2.5-7b"]) if r.repeat == 1}
    assert set(seven.values()) == {0.0}
    fourteen = [(r.system, r.resident) for r in expand(SUITES["dp-qwen2.5-14b"]) if r.repeat == 1]
    assert fourteen[:2] == [("slidekit", "auto")] * 2 and fourteen[-1] == ("deepspeed", None)


def test_every_child_of_a_multi_gpu_suite_has_nvlink_multicast_off_and_ranks_their_threads():
    suite = SUITES["dp-qwen2.5-7b"]
    runs = expand(suite)
    for run in runs:
        env = child_env(suite, run, environ={})
        assert MULTICAST_OFF.items() <= env.items(), run.name
        cpus = len(os.sched_getaffinity(0))
        assert env.get("OMP_NUM_THREADS") == (str(max(1, cpus // 2)) if run.ranks == 2 else None), run.name
    assert MULTICAST_OFF.items() <= child_env(suite, None, environ={}).items()  # the builds too
    ranked = next(r for r in runs if r.ranks == 2)
    assert "OMP_NUM_THREADS" not in child_env(
        suite, ranked, environ={"OMP_NUM_THREADS": "3"}
    )  # the user's wins
    assert (
        child_env(SUITES["qwen2.5-7b"], expand(SUITES["qwen2.5-7b"])[0], environ={}) == {}
    )  # one GPU: unchanged
    assert MULTICAST_OFF == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }


def test_a_run_on_two_gpus_costs_one_gpus_run_with_collectives_and_a_launcher():
    one, two = cost_of("qwen2.5-7b", "slidekit:none"), cost_of("qwen2.5-7b", "slidekit:none@2")
    assert two.setup_s == one.setup_s + RANK_SETUP_S
    assert two.step_s(8) == pytest.approx(one.step_s(8) * RANK_STEP_FACTOR)
    suite = SUITES["dp-qwen2.5-7b"]
    runs = {(r.resident, r.ranks): r for r in expand(suite) if r.repeat == 1 and r.system == "slidekit"}
    p1 = predict(runs[("none", 1)], suite.model, steps=suite.steps, warmup=suite.warmup)
    p2 = predict(runs[("none", 2)], suite.model, steps=suite.steps, warmup=suite.warmup)
    steps = suite.steps + suite.warmup
    assert p2 - p1 == pytest.approx(TORCHRUN_S + RANK_SETUP_S + steps * (two.step_s(8) - one.step_s(8)))
    # DeepSpeed exhausted the 1-GPU machine's RAM at 7B; on 2 GPUs (256 GB) its steps come from 3B by params.
    ds = cost_of("qwen2.5-7b", "deepspeed@2")
    assert ds.host_oom_s is None and ds.steps and "qwen2.5-3b x params" in ds.source
    assert cost_of("qwen2.5-14b", "deepspeed@2").host_oom_s is not None  # >= 340 GB of the 256
    # Each suite's core fits one call of the 2-GPU machine (budget 545 s after the install).
    for name in ("dp-qwen2.5-7b", "dp-qwen2.5-14b"):
        plan = make_plan(SUITES[name], expand(SUITES[name]), budget_s=545.0, prebuild=True)
        assert all(p.keep for p in plan.runs if p.run.importance == 0.0) and plan.predicted_s <= 545.0


def _row(label, ranks, tokens, *, system="slidekit", family=None, batch=8, **kw):
    per_gpu = tokens / ranks
    row = {"record": "run", "label": label, "system": system, "batch": batch, "max_grad_norm": None}
    row |= {"ranks": ranks, "family": family or label, "status": "ok", "tokens_per_s": tokens}
    row |= {"tokens_per_s_per_gpu": per_gpu, "model_tflops": 1.0, "mean_step_s": 1.0, "run_name": label}
    return row | kw


def test_the_table_s_scaling_efficiency_and_ratios_compare_like_with_like():
    ranks2 = [
        {"rank": 0, "peak_host_rss_gib": 46.0, "update_s": 0.9, "reduce_s": 0.2, "gather_s": 0.1},
        {"rank": 1, "peak_host_rss_gib": 47.5, "update_s": 1.1, "reduce_s": 0.3, "gather_s": 0.1},
    ]
    rows = [
        _row(
            "slidekit (resident none)",
            1,
            1000.0,
            per_rank=[{"rank": 0, "peak_host_rss_gib": 90.0, "update_s": 1.6}],
        ),
        _row("slidekit (resident none)", 1, 1200.0, repeat=2),  # median over the repeats: 1100
        _row(
            "slidekit (resident none) on 2 GPUs",
            2,
            1980.0,
            family="slidekit (resident none)",
            per_rank=ranks2,
        ),
        _row("slidekit (resident all)", 1, 5000.0),
        _row("slidekit (resident all) on 2 GPUs", 2, 9600.0, family="slidekit (resident all)"),
        _row(
            "DeepSpeed ZeRO-2 Offload on 2 GPUs",
            2,
            900.0,
            system="deepspeed",
            family="DeepSpeed ZeRO-2 Offload",
        ),
        _row(
            "DeepSpeed ZeRO-2 Offload on 2 GPUs", 2, 0.0, system="deepspeed", status="unavailable", reason="x"
        ),
    ]
    rows[-2]["process_peak_rss_gib"] = 180.0
    found = {c.label: c for c in cells(rows)}
    # tokens/s per GPU on 2 / the same mode's tokens/s on 1 (the median of its repeats), at the same batch.
    assert scaling(found["slidekit (resident none) on 2 GPUs"], list(found.values())) == pytest.approx(990 / 1100)
    assert scaling(found["slidekit (resident all) on 2 GPUs"], list(found.values())) == pytest.approx(4800 / 5000)
    assert scaling(found["slidekit (resident none)"], list(found.values())) is None  # one GPU: the reference
    # Offload efficiency and "vs DeepSpeed" only against runs on as many GPUs.
    assert found["slidekit (resident none) on 2 GPUs"].efficiency == pytest.approx(1980 / 9600)
    assert found["slidekit (resident none)"].efficiency == pytest.approx(1100 / 5000)
    assert found["slidekit (resident none)"].vs["deepspeed"] is None
    assert found["slidekit (resident none) on 2 GPUs"].vs["deepspeed"] == pytest.approx(1980 / 900)
    table = dp_table(rows)
    line = next(ln for ln in table.splitlines() if ln.startswith("| slidekit (resident none) on 2 GPUs |"))
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert cols[3:8] == ["2", "1,980 [1,980-1,980] (1)", "990", f"{990 / 1100:.2f}", f"{1980 / 900:.2f}x"]
    assert cols[8:] == ["46.0, 47.5 (host 93.5)", "0.900, 1.100 (host 2.000)", "0.200, 0.300", "0.100, 0.100"]
    ds = next(ln for ln in table.splitlines() if ln.startswith("| DeepSpeed"))
    assert "180.0 (all ranks)" in ds
    page = suite_markdown({"name": "dp", "suite": {}}, rows, records_name="x.jsonl")
    assert "### Data parallelism" in page
    assert "### Data parallelism" not in suite_markdown(
        {"name": "one", "suite": {}}, rows[:2], records_name="x"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_deadline_kills_the_whole_tree_also_a_grandchild_in_its_own_session(tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            print(json.dumps({"status": "ok", "pid": child.pid}), flush=True)
            time.sleep(120)
            """
        )
    )
    run = stream_child([sys.executable, str(script)], timeout=5.0)
    assert run.returncode is None and run.records  # killed at its deadline, its line kept
    grandchild = run.records[0]["pid"]
    for _ in range(100):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} in its own session survived its parent's deadline")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_tree_of_a_process_holds_its_descendants_in_new_sessions():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True); "
         "print(c.pid, flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        grandchild = int(proc.stdout.readline())  # type: ignore[union-attr]
        assert {proc.pid, grandchild} <= set(process_tree(proc.pid))
    finally:
        for pid in process_tree(proc.pid):
            os.kill(pid, 9)
        proc.wait()


@pytest.mark.slow
def test_a_two_rank_run_through_the_runner_prints_one_record_with_every_rank(tmp_path, monkeypatch):
    """torchrun --nproc-per-node 2 -m slidekit.tools.bench --model tiny --device cpu --batch 2 --seq 32
    --steps 2 --warmup 1, started by run_suite as a suite's run on 2 GPUs."""
    # The runner sets OMP_NUM_THREADS only where the bench's own environment leaves it unset (the GPU
    # gate sets it for its pytest workers).
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    suite = Suite(
        name="dp-tiny",
        model="tiny",
        batches=(2,),
        modes=(Mode(resident="none", ranks=2),),
        alternatives=(),
        clips=(None,),
        repeats=1,
        seq=32,
        steps=2,
        warmup=1,
    )
    args = _args("--logs", str(tmp_path))
    args.timeout = 240.0
    plan = make_plan(suite, expand(suite), budget_s=None, prebuild=False)
    recorder = Recorder(tmp_path / "suite.jsonl", {"record": "suite", "name": suite.name})
    rows = run_suite(args, plan, recorder, identity={}, watchdog=None)
    mine = [r for r in rows if r["system"] == "slidekit"]
    log = next(tmp_path.glob("slidekit_resident_none_on_2_GPUs*.log")).read_text()
    assert len(mine) == 1 and mine[0]["status"] == "ok", log[-3000:]
    (row,) = mine
    # Exactly one line came back: rank 0's (the log holds the child's whole standard output).
    stdout = log.split("--- stdout\n", 1)[1].split("\n--- stderr\n", 1)[0]
    assert len([ln for ln in stdout.splitlines() if ln.startswith("{")]) == 1, stdout
    assert row["world"] == 2 and row["ranks"] == 2 and row["backend"] == "gloo"
    assert row["family"] == "slidekit (resident none)" and row["env"]["OMP_NUM_THREADS"]
    per_rank = row["per_rank"]
    assert [r["rank"] for r in per_rank] == [0, 1]
    for r in per_rank:
        assert r["peak_host_rss_gib"] > 0 and r["update_s"] > 0 and r["reduce_s"] > 0 and r["gather_s"] > 0
        assert r["threads"] == int(row["env"]["OMP_NUM_THREADS"])  # torchrun's 1 replaced by the runner's
        # A step of the record is the slowest rank's: no rank's timed steps add up to more.
        assert r["period_s"] <= row["period_s"] + 1e-5
    period = sum(row["step_seconds"])
    assert row["tokens_per_s"] == round(2 * 2 * 32 * 2 / period, 1)
    assert row["tokens_per_s_per_gpu"] == round(row["tokens_per_s"] / 2, 1)
    assert row["host_update_s"] == pytest.approx(sum(r["update_s"] for r in per_rank), abs=1e-4)
