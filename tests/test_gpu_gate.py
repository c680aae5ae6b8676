"""The GPU gate's bookkeeping (benchmarks/gpu_gate.py): what a record covers, how it is judged, one run.

The gate itself runs on the GPU machine; here its pieces run on the CPU: the
source digest, the check of a record against a commit (in a scratch git
repository), the JUnit counts, the verdict, the atomic record and one short
training run through the same child-process path the gate takes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from bench_helpers import load_benchmark


def _gate():
    return load_benchmark("gpu_gate")


gate = _gate()


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A scratch checkout with slidekit/ and plugins/ and one commit."""
    (tmp_path / "slidekit").mkdir()
    (tmp_path / "plugins" / "p").mkdir(parents=True)
    (tmp_path / "slidekit" / "a.py").write_text("A = 1\n")
    (tmp_path / "plugins" / "p" / "k.cpp").write_text("int k;\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("docs\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_the_digest_covers_every_source_file_and_nothing_else(repo: Path):
    base = gate.source_digest(repo)
    (repo / "slidekit" / "__pycache__").mkdir()
    (repo / "slidekit" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (repo / "plugins" / "p" / "k.so").write_bytes(b"\0")
    (repo / "docs" / "x.md").write_text("other docs\n")
    assert gate.source_digest(repo) == base  # caches, build products and docs are not code
    (repo / "plugins" / "p" / "k.cpp").write_text("int k2;\n")
    assert gate.source_digest(repo) != base
    (repo / "plugins" / "p" / "k.cpp").write_text("int k;\n")
    (repo / "slidekit" / "b.py").write_text("")  # a new, empty file counts
    assert gate.source_digest(repo) != base
    assert gate.commit_digest("HEAD", repo) == base  # read from git, not from the work tree


def test_a_record_covers_a_commit_only_with_its_sources_and_a_pass(repo: Path, tmp_path_factory):
    record = tmp_path_factory.mktemp("rec") / "GPU-VERIFIED.json"
    first = _git(repo, "rev-parse", "HEAD")
    ok, why = gate.check(record, first, repo)
    assert not ok and "no record" in why
    entry = {"commit": first, "source_digest": gate.source_digest(repo), "ok": True, "date": "d"}
    gate.write_record(entry, [record])
    assert gate.check(record, first, repo)[0]

    # A later commit that leaves slidekit/ and plugins/ alone is covered by the same record...
    (repo / "docs" / "x.md").write_text("more docs\n")
    _git(repo, "commit", "-qam", "docs")
    assert gate.check(record, _git(repo, "rev-parse", "HEAD"), repo)[0]
    # ...one that touches them is not.
    (repo / "slidekit" / "a.py").write_text("A = 2\n")
    _git(repo, "commit", "-qam", "code")
    ok, why = gate.check(record, _git(repo, "rev-parse", "HEAD"), repo)
    assert not ok and "run the gate again" in why
    # A failed gate never verifies, even on the right sources.
    gate.write_record({**entry, "ok": False, "why": "2 tests failed, 0 errors"}, [record])
    ok, why = gate.check(record, first, repo)
    assert not ok and "2 tests failed" in why
    record.write_text("{torn")
    assert not gate.check(record, first, repo)[0]


def test_the_record_says_whether_its_commit_is_the_tree_that_ran(repo: Path):
    """A device copy with stale git metadata names an older commit than the tree: the record says so."""
    first = _git(repo, "rev-parse", "HEAD")
    assert gate.commit_matches_tree(first, gate.source_digest(repo), repo) is True
    (repo / "slidekit" / "a.py").write_text("A = 2\n")  # the tree moved on; HEAD did not
    assert gate.commit_matches_tree(first, gate.source_digest(repo), repo) is False
    assert gate.commit_matches_tree("0" * 40, gate.source_digest(repo), repo) is None  # git does not have it
    assert gate.commit_matches_tree(None, gate.source_digest(repo), repo) is None


def test_junit_counts_and_the_verdict(tmp_path: Path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="ok1" time="0.5"/><testcase classname="tests.a" name="ok2" time="7.31"/>'
        '<testcase classname="tests.b" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="broken"><error message="y"/></testcase>'
        '<testcase classname="tests.c" name="gpu"><skipped message="needs CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    counts = gate.junit_counts(xml)
    assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 2,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
    }
    assert counts["failures"] == ["tests.b::bad", "tests.b::broken"]
    assert counts["slowest"][:2] == [["tests.a::ok2", 7.3], ["tests.a::ok1", 0.5]]  # no time: 0
    assert len(counts["slowest"]) == 5
    assert counts["test_seconds"] == 7.8  # 0.5 + 7.31, the rest without a time

    clean = {"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "exit_code": 0}
    run = {"gpu_resident": "all", "status": "ok"}
    assert gate.verdict(clean, [run]) == (True, "all passed")
    assert not gate.verdict({**clean, "failed": 1, "exit_code": 1}, [run])[0]
    assert not gate.verdict({**clean, "timed_out": True, "seconds": 9}, [run])[0]
    assert not gate.verdict(None, [run])[0]
    ok, why = gate.verdict(clean, [run, {"gpu_resident": "none", "status": "failed", "why": "OOM"}])
    assert not ok and "gpu_resident=none: OOM" in why


def test_the_suite_reports_its_counts_and_an_overrun_still_names_its_failures(tmp_path: Path):
    suite = tmp_path / "test_sample.py"
    suite.write_text(
        "import time\ndef test_ok(): pass\ndef test_bad(): assert False\ndef test_stuck(): time.sleep(600)\n"
    )
    result = gate.run_suite(120, tmp_path / "log", ["-k", "not stuck"], paths=[str(suite)])
    assert (result["passed"], result["failed"], result["timed_out"]) == (1, 1, False)
    (failed,) = result["failures"]  # its class path depends on where pytest puts its rootdir
    assert failed.endswith("test_sample::test_bad") and result["exit_code"] == 1
    rows = json.loads(gate.durations_path(tmp_path / "log").read_text())  # every test that ran, with its time
    assert [n.rsplit("::", 1)[1] for n, _ in rows] == ["test_ok", "test_bad"] and all(t >= 0 for _, t in rows)
    assert result["test_seconds"] == pytest.approx(sum(t for _, t in rows), abs=0.1)

    # The stuck test is interrupted at the deadline; what ran before it is still counted. The deadline is
    # ample for the start and the two tests before it, as long as the run above took on this machine, now.
    deadline = min(300.0, max(30.0, 3 * result["seconds"]))
    result = gate.run_suite(deadline, tmp_path / "log", paths=[str(suite)])
    assert result["timed_out"] and (result["passed"], result["failed"], result["interrupted"]) == (1, 1, 1)
    assert not gate.verdict(result, [{"gpu_resident": "all", "status": "ok"}])[0]


def test_the_record_is_written_before_each_phase_and_the_suite_gets_what_the_runs_leave(
    tmp_path: Path, monkeypatch
):
    """A gate killed from outside (a device call's limit) leaves the record of what it had found."""
    monkeypatch.delenv("OUT", raising=False)
    record = tmp_path / "GPU-VERIFIED.json"
    seen: list[tuple[str, float, str]] = []
    clock = [0.0]
    monkeypatch.setattr(gate.time, "perf_counter", lambda: clock[0])

    def suite(timeout, log, extra=(), workers=1, paths=("tests",), slow_first=()):
        written = json.loads(record.read_text())
        assert not written["ok"] and [r["gpu_resident"] for r in written["runs"]] == ["all", "none"]
        seen.append(("suite", timeout, written["why"]))
        return {"passed": 3, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0, "seconds": 1.0}

    def run(args, mode, timeout):
        seen.append((mode, timeout, json.loads(record.read_text())["why"]))
        clock[0] += 45.0  # each run takes 45 s of the deadline
        return {"gpu_resident": mode, "status": "ok"}

    monkeypatch.setattr(gate, "run_suite", suite)
    monkeypatch.setattr(gate, "run_mode", run)
    argv = ["--allow-cpu", "--record", str(record), "--commit", "abc", "--modes", "all,none"]
    argv += ["--deadline", "500", "--run-timeout", "60", "--tests-timeout", "480"]
    assert gate.main(argv) == 0
    (_, all_s, before_all), (_, none_s, before_none), (_, suite_s, before_suite) = seen
    assert all_s == none_s == 60
    assert before_all.startswith("incomplete: the runs all, none had not finished")
    assert before_none.startswith("incomplete: the runs none had not finished")
    assert suite_s == 410  # 500 s less the two runs' 90 s, not less two whole run timeouts
    assert before_suite.startswith("incomplete: the test suite is running")
    final = json.loads(record.read_text())
    modes = [r["gpu_resident"] for r in final["runs"]]
    assert final["ok"] and final["why"] == "all passed" and modes == ["all", "none"]
    # A deadline nearly spent leaves the last run what remains.
    seen.clear()
    clock[0] = 0.0
    assert gate.main([*argv[:-6], "--deadline", "80", "--run-timeout", "60", "--tests-timeout", "480"]) == 0
    assert [t for _, t, _ in seen] == [60, 35, 1.0]
    # Without a deadline the suite gets its own timeout.
    seen.clear()
    assert gate.main([*argv[:-6], "--tests-timeout", "480"]) == 0
    assert seen[-1][:2] == ("suite", 480)


def test_a_deadline_shorter_than_the_recorded_gate_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch, capsys
):
    """Session 30: a 395 s deadline cut the suite off after 270 s with nothing failed, and verified nothing."""
    monkeypatch.delenv("OUT", raising=False)
    record = tmp_path / "GPU-VERIFIED.json"
    earlier = {
        "commit": "3c9321279b75",
        "date": "2026-12-07T07:23:05+00:00",
        "machine": {"gpu": "NVIDIA H100 80GB HBM3"},
        "runs": [
            {"gpu_resident": m, "wall_s": w} for m, w in [("all", 32.5), ("auto", 20.2), ("none", 29.6)]
        ],
        "tests": {"seconds": 280.0},
    }
    record.write_text(json.dumps(earlier))
    started: list[str] = []
    monkeypatch.setattr(
        gate, "run_mode", lambda args, mode, timeout: started.append(mode) or {"gpu_resident": mode, "status": "ok"}
    )
    passed = {"passed": 3, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0, "seconds": 1.0}
    monkeypatch.setattr(gate, "run_suite", lambda *a, **k: started.append("suite") or passed)
    base = ["--allow-cpu", "--record", str(record), "--commit", "abc", "--modes", "all,auto,0.5,none"]
    # 0.5 has no run in the record: the runs' mean stands for it. 32.5 + 20.2 + 27.43 + 29.6 + 280 = 389.7 s.
    assert gate.expected_seconds(record, ["all", "auto", "0.5", "none"])[0] == pytest.approx(389.73, abs=0.01)
    assert gate.main([*base, "--deadline", "395"]) == 2
    said = capsys.readouterr().out
    assert (
        "not started" in said and "--deadline 429 or more" in said and "3c9321279b75 on NVIDIA H100" in said
    )
    assert started == [] and json.loads(record.read_text()) == earlier  # nothing ran, the record untouched
    assert gate.main([*base, "--deadline", "429"]) == 0 and started == ["all", "auto", "0.5", "none", "suite"]
    record.write_text(json.dumps(earlier))
    started.clear()
    assert gate.main([*base, "--deadline", "395", "--force"]) == 0 and len(started) == 5
    # Without a deadline, or without a readable record with a suite, nothing is refused.
    record.write_text(json.dumps(earlier))
    assert gate.deadline_too_short(gate.parser().parse_args(base), ["all"]) is None
    record.write_text("{not json")
    assert gate.deadline_too_short(gate.parser().parse_args([*base, "--deadline", "1"]), ["all"]) is None


@pytest.mark.slow
def test_one_run_per_mode_through_the_child_process_path(tmp_path: Path, monkeypatch):
    """The gate's runs on the tiny preset, on the CPU: whole-step timing, peaks and the record."""
    # The gate also writes its record into $OUT: under the real gate (the device machine sets OUT) this
    # test's record would land where the real one goes.
    monkeypatch.delenv("OUT", raising=False)
    record = tmp_path / "GPU-VERIFIED.json"
    argv = ["--allow-cpu", "--skip-tests", "--model", "tiny", "--batch", "2", "--seq", "16"]
    argv += [
        "--warmup",
        "1",
        "--steps",
        "2",
        "--modes",
        "all,none",
        "--record",
        str(record),
        "--commit",
        "abc",
    ]
    assert gate.main(argv) == 1  # the suite was skipped, so the gate cannot pass
    written = json.loads(record.read_text())
    assert written["commit"] == "abc" and written["source_digest"] == gate.source_digest()
    assert not written["ok"] and written["why"] == "the test suite was not run"
    by_mode = {r["gpu_resident"]: r for r in written["runs"]}
    assert by_mode["all"]["resident_units"] == "6/6" and by_mode["none"]["resident_units"] == "0/6"
    for run in written["runs"]:
        assert run["status"] == "ok" and run["steps"] == 2 and len(run["step_seconds"]) == 2
        # start to start, drained: the period holds every timed step
        assert run["period_s"] >= sum(run["step_seconds"])
        assert abs(run["tokens_per_s"] - 2 * 16 * 2 / run["period_s"]) <= 0.05  # rounded to 0.1 from it
    assert by_mode["all"]["losses"] == by_mode["none"]["losses"]  # residency never changes the math


@pytest.mark.parametrize(
    ("installed", "mode"), [("3.8.0", "worksteal"), ("3.2", "worksteal"), ("3.1.1", "load"), (None, "load")]
)
def test_the_suite_is_spread_test_by_test(monkeypatch, installed, mode):
    """Never whole files per worker: one file of slow tests made the suite's critical path."""
    import importlib.metadata as metadata

    def version(name: str) -> str:
        assert name == "pytest-xdist"
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(metadata, "version", version)
    assert gate.xdist_mode() == mode


def test_a_gate_in_two_calls_completes_the_runs_of_its_own_sources(tmp_path: Path, monkeypatch, capsys):
    """Session 35's gate took 531 s of a device call's 600 s: --part runs, then --part tests, on one tree."""
    monkeypatch.delenv("OUT", raising=False)
    record = tmp_path / "GPU-VERIFIED.json"
    earlier = {"commit": "0ld", "source_digest": "d0", "runs": [{"gpu_resident": "all", "wall_s": 30.0}],
               "tests": {"seconds": 380.0}, "ok": True}  # fmt: skip
    record.write_text(json.dumps(earlier))
    digest, started = ["d1"], []
    suites = [{"passed": 2, "failed": 1, "errors": 0, "skipped": 0, "exit_code": 1, "seconds": 370.0,
               "failures": ["t::bad"]}]  # fmt: skip
    monkeypatch.setattr(gate, "source_digest", lambda: digest[0])
    monkeypatch.setattr(
        gate, "run_mode", lambda a, mode, t: started.append(mode) or {"gpu_resident": mode, "status": "ok", "wall_s": 40.0}
    )
    monkeypatch.setattr(gate, "run_suite", lambda *a, **k: started.append("suite") or suites.pop(0))
    base = ["--allow-cpu", "--record", str(record), "--commit", "abc", "--modes", "all,none"]

    # The runs: recorded as incomplete, the suite of the record they replace kept for the next deadline.
    assert gate.main([*base, "--part", "runs"]) == 0 and started == ["all", "none"]
    runs = json.loads(record.read_text())
    assert not runs["ok"] and runs["tests"] is None and runs["part"] == "runs"
    assert runs["why"].startswith("incomplete: the test suite (gpu_gate.py --part tests")
    assert runs["last_suite"] == {"seconds": 380.0, "of_commit": "0ld"}
    assert gate.expected_seconds(record, [], suite=True)[0] == 380.0  # the suite's deadline: 1.1 x 380 s
    assert gate.expected_seconds(record, ["all", "none"], suite=False)[0] == 80.0

    # The suite with a deadline shorter than 1.1 x the last suite is refused before it runs.
    started.clear()
    assert gate.main([*base, "--part", "tests", "--deadline", "400"]) == 2 and started == []
    assert "took 380 s for the suite" in capsys.readouterr().out

    # The suite fails: the record keeps the runs and says so.
    assert gate.main([*base, "--part", "tests", "--deadline", "419"]) == 1 and started == ["suite"]
    failed = json.loads(record.read_text())
    assert not failed["ok"] and failed["why"] == "1 tests failed, 0 errors" and failed["runs"] == runs["runs"]
    assert failed["runs_part"]["date"] == runs["date"] and failed["runs_part"]["command"] == runs["command"]

    # A test mended in tests/ (the sources unchanged): the suite again completes the same runs.
    suites.append({"passed": 3, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0, "seconds": 360.0})
    started.clear()
    assert gate.main([*base, "--part", "tests"]) == 0 and started == ["suite"]
    done = json.loads(record.read_text())
    assert done["ok"] and done["why"] == "all passed" and done["runs"] == runs["runs"] and done["part"] == "tests"
    assert done["runs_part"] == failed["runs_part"] and done["source_digest"] == "d1"

    # Other sources than the runs': refused before anything runs, the record untouched.
    digest[0] = "d2"
    started.clear()
    assert gate.main([*base, "--part", "tests"]) == 2 and started == []
    said = capsys.readouterr().out
    assert "not started" in said and "other slidekit/ and plugins/" in said and "--part runs first" in said
    assert json.loads(record.read_text()) == done
    record.write_text(json.dumps({"commit": "x", "source_digest": "d2", "runs": []}))
    assert gate.main([*base, "--part", "tests"]) == 2 and "holds no runs" in capsys.readouterr().out

    # A whole gate too long for its deadline names the split.
    record.write_text(json.dumps(done))
    assert gate.main([*base, "--deadline", "100"]) == 2
    assert "--part runs, then --part tests" in capsys.readouterr().out
