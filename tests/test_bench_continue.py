"""`slidekit bench --continue`: a suite measured over several calls, one file, one code.

A first call on a budget measures the most important runs and leaves the rest "not run"; a second
call with ``--continue`` runs exactly those (a run cut off midway again, whole), and the file holds
every run once, the header listing both calls. Another suite's records, or records of other code
(another source digest), or of another machine or software (GPU, CPU, RAM, versions), or of another
host (its boot id, unless ``--other-host``), are refused with what to do. The systems are the stand-in scripts of
``bench_helpers.fake_systems``; the budget clock takes each run's predicted time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_helpers import clock_of_predictions, fake_systems

from slidekit.errors import ConfigError
from slidekit.tools.bench import bench
from slidekit.tools.bench import cli as bench_cli
from slidekit.tools.bench.cli import build_suite
from slidekit.tools.bench.records import machine, versions
from slidekit.tools.bench.suites import expand
from slidekit.tools.bench.timeplan import make_plan
from slidekit.tools.source_digest import source_digest


def _argv(scripts: Path, out: Path, *extra: str) -> list[str]:
    argv = ["bench", "--model", "tiny", "--batch", "2,3", "--seq", "16", "--steps", "2", "--warmup", "1"]
    argv += ["--resident", "all,none", "--baselines", "liger_gc,none", "--repeats", "2", "--no-prebuild"]
    return [*argv, "--baselines-dir", str(scripts), "--out", str(out), *extra]


def _parse(argv: list[str]):
    from slidekit.cli import build_parser

    return build_parser().parse_args(argv)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    directory = tmp_path / "scripts"
    directory.mkdir()
    fake_systems(directory)
    return directory


def test_a_second_call_runs_what_the_first_left_and_the_file_holds_both(tmp_path, scripts, monkeypatch):
    first, second = tmp_path / "call1", tmp_path / "call2"
    the_suite = build_suite(_parse(_argv(scripts, first)))
    runs = make_plan(the_suite, expand(the_suite), budget_s=None, prebuild=False).runs
    budget = sum(p.predicted_s for p in runs[:3]) + 0.5  # the first three runs, most important first
    clock = clock_of_predictions(monkeypatch)
    bench(_parse(_argv(scripts, first, "--time-budget", str(budget), "--commit", "aaa")), clock=clock)
    rows1 = [r for r in _lines(first / "suite-tiny.jsonl") if r.get("record") == "run"]
    measured = {r["run_name"] for r in rows1 if r["status"] != "not run"}
    left = {r["run_name"] for r in rows1 if r["status"] == "not run"}
    assert measured == {p.run.name for p in runs[:3]} and left == {p.run.name for p in runs[3:]}

    # A cut-off call: the last measured run kept one of its two batches' rows.
    cut = runs[2].run.name
    lines = _lines(first / "suite-tiny.jsonl")
    dropped = next(i for i, r in enumerate(lines) if r.get("run_name") == cut and r.get("batch") == 3)
    (first / "suite-tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:dropped] + lines[dropped + 1 :]))

    started: list[str] = []
    real = bench_cli.run_suite

    def run_suite(args, plan, recorder, **kw):
        started.extend(p.run.name for p in plan.runs)
        return real(args, plan, recorder, **kw)

    monkeypatch.setattr(bench_cli, "run_suite", run_suite)
    rows = bench(
        _parse(_argv(scripts, second, "--continue", str(first / "suite-tiny.jsonl"), "--commit", "bbb")),
        clock=clock,
    )
    assert set(started) == left | {cut}  # the cut-off run again, whole; nothing measured twice
    records = _lines(second / "suite-tiny.jsonl")
    header, body = records[0], records[1:]
    assert body == rows
    keys = [(r["run_name"], r["batch"]) for r in body]
    assert len(keys) == len(set(keys)) == len(expand(the_suite)) * 2  # every run and batch once
    assert all(r["status"] == "ok" for r in body)
    assert {r["commit"] for r in body if r["run_name"] in measured - {cut}} == {"aaa"}
    assert {r["commit"] for r in body if r["run_name"] in left | {cut}} == {"bbb"}
    assert [c["commit"] for c in header["calls"]] == ["aaa", "bbb"]
    assert header["source_digest"] == source_digest()
    text = (second / "suite-tiny.md").read_text()
    assert "Commits `aaa`, `bbb` (the same slidekit/ and plugins/, source digest" in text
    host = machine()
    assert header["machine"] == host and f"{host['cpus']} CPUs, {host['host_ram_gib']} GiB RAM" in text
    assert "2 `slidekit bench` calls" in text

    # A third call finds nothing left: it plans no run and keeps every row.
    started.clear()
    third = tmp_path / "call3"
    bench(_parse(_argv(scripts, third, "--continue", str(second / "suite-tiny.jsonl"))), clock=clock)
    assert started == [] and [r for r in _lines(third / "suite-tiny.jsonl")[1:]] == body
    assert len(_lines(third / "suite-tiny.jsonl")[0]["calls"]) == 3


def _header_file(tmp_path: Path, scripts: Path, **change) -> Path:
    """A suite file with a header like this tree's first call would write, ``change`` applied."""
    args = _parse(_argv(scripts, tmp_path / "x"))
    the_suite = build_suite(args)
    header = {"record": "suite", "name": the_suite.name, "model": the_suite.model, "source_digest": source_digest()}
    header["suite"] = {"seq": 16, "steps": 2, "warmup": 1, "batches": [2, 3], "clips": [None], "repeats": 2}
    header["suite"]["partial"] = the_suite.partial
    header["machine"], header["versions"] = machine(), versions()
    for key, value in change.items():
        if key in header["suite"]:
            header["suite"][key] = value
        elif key in header["machine"]:
            header["machine"][key] = value(header["machine"][key])
        elif key in header["versions"]:
            header["versions"][key] = value
        elif value is None:
            header.pop(key)
        else:
            header[key] = value
    path = tmp_path / "earlier.jsonl"
    path.write_text(json.dumps(header) + "\n")
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({}, None),
        ({"steps": 3}, "another suite (steps 3 there, 2 here)"),
        ({"name": "qwen2.5-3b"}, "another suite (name 'qwen2.5-3b' there, 'tiny' here"),
        ({"source_digest": "f" * 64}, "measured other code (source digest ffffffffffff there"),
        ({"source_digest": None}, "carry no source digest"),
        # a name no host has: the gate runs this on an H200, where "NVIDIA H200" was this machine's own
        ({"gpu": lambda _: "Other GPU (test)"}, "another machine or software (gpu 'Other GPU (test)' there"),
        ({"cpu_model": lambda _: "Other CPU"}, "cpu_model 'Other CPU' there"),
        ({"cpus": lambda n: n * 2}, "cpus "),
        ({"host_ram_gib": lambda g: round(g * 1.5, 1)}, "host_ram_gib "),
        ({"host_ram_gib": lambda g: round(g * 1.01, 1)}, None),  # the same kind of host, a few MiB apart
        ({"torch": "0.0.1"}, "torch '0.0.1' there"),
        ({"slidekit": "0.0.1"}, None),  # the source digest covers slidekit's own code
        ({"machine": None}, "no machine recorded there"),
        ({"boot_id": lambda _: "0ther-b00t"}, "another host, or the same one rebooted (boot id 0ther-b0 there"),
        ({"boot_id": lambda _: None}, "no boot id recorded there or here"),
    ],
)
def test_only_the_same_suite_and_code_continue(tmp_path, scripts, monkeypatch, change, message):
    earlier = _header_file(tmp_path, scripts, **change)
    monkeypatch.setattr(bench_cli, "run_suite", lambda *a, **k: [])  # nothing needs to run
    args = _parse(_argv(scripts, tmp_path / "out", "--continue", str(earlier)))
    if message is None:
        bench(args)
        return
    with pytest.raises(ConfigError, match="--continue") as raised:
        bench(args)
    assert message in str(raised.value)
    assert not (tmp_path / "out" / "suite-tiny.jsonl").exists()  # refused before anything is written


def test_other_host_continues_on_another_host_and_the_page_says_so(tmp_path, scripts, monkeypatch):
    """``--other-host``: a suite begun on another host (or before a reboot) continues; each call's entry
    keeps its boot id, and the page says the suite ran on two hosts."""
    earlier = _header_file(tmp_path, scripts, boot_id=lambda _: "0ther-b00t")
    monkeypatch.setattr(bench_cli, "run_suite", lambda *a, **k: [])
    bench(_parse(_argv(scripts, tmp_path / "out", "--continue", str(earlier), "--other-host")))
    header = _lines(tmp_path / "out" / "suite-tiny.jsonl")[0]
    assert [c["boot_id"] for c in header["calls"]] == ["0ther-b00t", machine()["boot_id"]]
    assert "on 2 hosts of one kind, continued with --other-host" in (tmp_path / "out" / "suite-tiny.md").read_text()


def test_a_file_that_is_no_suite_is_refused_saying_what_it_lacks(tmp_path, scripts):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match="no such file"):
        bench(_parse(_argv(scripts, tmp_path / "out", "--continue", str(missing))))
    rows_only = tmp_path / "rows.jsonl"
    rows_only.write_text(json.dumps({"record": "run", "run_name": "x", "batch": 2}) + "\n")
    with pytest.raises(ConfigError, match="no suite header line"):
        bench(_parse(_argv(scripts, tmp_path / "out", "--continue", str(rows_only))))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        bench(_parse(_argv(scripts, tmp_path / "out", "--continue", str(broken))))


def _half_done_run(tmp_path: Path):
    """A run of two batches whose process prints batch 2's line, then works on past any limit."""
    from slidekit.tools.bench.suites import RunSpec

    script = tmp_path / "slow.py"
    script.write_text(
        "import json, time\n"
        "print(json.dumps({'system': 'slidekit', 'status': 'ok', 'batch': 2, 'tokens_per_s': 1.0, 'model_tflops': 1.0}), flush=True)\n"
        "time.sleep(60)\n"
    )
    run = RunSpec(
        system="slidekit", label="slidekit (resident all)", kind="all", cost_key="slidekit:all", script="slidekit",
        flags=(), batches=(2, 3), clip=None, repeat=1, importance=0.0,
    )
    return run, [sys.executable, str(script)]


@pytest.mark.parametrize("call_end", [True, False])
def test_a_run_the_calls_end_stopped_is_not_run_and_a_continuation_runs_it_again(tmp_path, call_end):
    from slidekit.tools.bench import runner
    from slidekit.tools.bench.continuing import measured_runs

    run, cmd = _half_done_run(tmp_path)
    recorder = runner.Recorder(None, {"record": "suite"})
    base = {"record": "run", "run_name": run.name, "predicted_s": 40.0}
    runner._one_run(run, cmd, 1.0, base, recorder, None, None, None, call_end)
    rows = {r["batch"]: r for r in recorder.rows}
    assert rows[2]["status"] == "ok"  # what it finished stays in the file
    if call_end:  # stopped before it was done, by the call: no result, so --continue runs it again, whole
        assert rows[3]["status"] == "not run"
        assert rows[3]["reason"].startswith("not run: stopped at the call's end after 1 s (predicted 40 s)")
        assert measured_runs([run], recorder.rows) == set()
    else:  # its own limit: a slow run is a result
        assert rows[3]["status"] == "unavailable" and rows[3]["reason"] == "no line for batch 3; timed out after 1 s (raise --timeout or --time-budget)"
        assert measured_runs([run], recorder.rows) == {run.name}


@pytest.mark.parametrize(("budget", "stopped_by_the_call"), [(None, False), (10_000.0, False), ("three", True)])
def test_a_run_whose_limit_is_the_calls_end_is_told_so(tmp_path, scripts, monkeypatch, budget, stopped_by_the_call):
    from slidekit.tools.bench import runner

    clock = clock_of_predictions(monkeypatch)
    told: list[bool] = []
    real = runner._one_run

    def one_run(*args):
        told.append(args[-1])
        real(*args)

    monkeypatch.setattr(runner, "_one_run", one_run)
    the_suite = build_suite(_parse(_argv(scripts, tmp_path)))
    runs = make_plan(the_suite, expand(the_suite), budget_s=None, prebuild=False).runs
    if budget == "three":  # the first three runs' predictions: each run's own allowance (2 x + 30 s) is more
        budget = sum(p.predicted_s for p in runs[:3]) + 0.5
    extra = () if budget is None else ("--time-budget", str(budget))
    bench(_parse(_argv(scripts, tmp_path / "out", *extra)), clock=clock)
    assert told and set(told) == {stopped_by_the_call}


@pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc")
def test_a_memory_failure_in_the_records_continued_is_not_repeated(tmp_path, scripts, monkeypatch):
    """torchao exhausts host RAM in the first call; the continuing call's second repeat starts no process."""
    from bench_helpers import fake_machine

    def argv(out: Path, *extra: str) -> list[str]:
        base = ["bench", "--model", "tiny", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1"]
        base += ["--resident", "all", "--baselines", "torchao", "--repeats", "2", "--no-prebuild"]
        return [*base, "--baselines-dir", str(scripts), "--out", str(out), *extra]

    first, second = tmp_path / "call1", tmp_path / "call2"
    the_suite = build_suite(_parse(argv(first)))
    runs = make_plan(the_suite, expand(the_suite), budget_s=None, prebuild=False).runs
    last = runs[-1]  # the least important: torchao's second repeat
    assert (last.run.label, last.run.repeat) == ("torchao CPUOffloadOptimizer", 2)
    budget = sum(p.predicted_s for p in runs[:-1]) + 0.5
    clock = clock_of_predictions(monkeypatch)
    bench(_parse(argv(first, "--time-budget", str(budget))), watchdog=fake_machine(), clock=clock)
    lines = _lines(first / "suite-tiny.jsonl")
    rows1 = {(r["label"], r["repeat"]): r for r in lines[1:]}
    assert rows1[("torchao CPUOffloadOptimizer", 1)]["reason"].startswith("host RAM exhausted")
    # Not repeated already in this call, budget or not; records of a runner before this rule said "not run".
    earlier = rows1[("torchao CPUOffloadOptimizer", 2)]
    assert earlier["not_repeated"] == 1
    del earlier["not_repeated"]
    earlier |= {"status": "not run", "reason": "not run: time budget (predicted 9 s; 1 s were left)"}
    (first / "suite-tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))

    rows = bench(
        _parse(argv(second, "--continue", str(first / "suite-tiny.jsonl"))), watchdog=fake_machine(), clock=clock
    )
    again = next(r for r in rows if r["label"] == "torchao CPUOffloadOptimizer" and r["repeat"] == 2)
    assert again["status"] == "unavailable" and again["not_repeated"] == 1 and "process_wall_s" not in again
    assert next(r for r in rows if r["label"] == "slidekit (resident all)" and r["repeat"] == 2)["status"] == "ok"
