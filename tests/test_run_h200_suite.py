"""``benchmarks/run_h200.sh suite``: the arguments it gives ``slidekit bench``, with and without an earlier
call's records carried as ``cont/suite-NAME.jsonl``.

The script runs on the GPU machine; here a stand-in ``python3`` on PATH prints the bench's arguments and
makes a log, so the stage's shell logic (continuation, extra options, budget, logs tarball) runs on the CPU.

Test: ``pytest tests/test_run_h200_suite.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run_h200.sh"

STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "slidekit.cli" ]; then
  echo "BENCH: ${*:3}"
  while [ $# -gt 0 ]; do [ "$1" = "--logs" ] && mkdir -p "$2" && echo run > "$2/run.log"; shift; done
fi
exit 0
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _suite(tmp_path: Path, *args: str, budget: str | None = None) -> tuple[str, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "python3"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(out),
        "LOGS": str(tmp_path / "logs"),
    }
    if budget is not None:
        env["BUDGET"] = budget
    done = subprocess.run(
        ["bash", str(SCRIPT), "suite", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    bench = [line for line in done.stdout.splitlines() if line.startswith("BENCH: ")]
    assert len(bench) == 1, done.stdout
    return bench[0].removeprefix("BENCH: "), out


def test_a_first_call_runs_the_suite_with_its_budget_and_returns_the_logs(tmp_path):
    args, out = _suite(tmp_path, "qwen2.5-7b", "abc1234")
    words = args.split()
    assert words[:4] == ["bench", "--suite", "qwen2.5-7b", "--commit"] and words[4] == "abc1234"
    budget = int(words[words.index("--time-budget") + 1])
    assert 500 <= budget <= 575  # 575 less the seconds the install took
    assert "--continue" not in words and words[words.index("--out") + 1] == str(out)
    with tarfile.open(out / "logs.tgz") as tar:
        assert "logs/run.log" in tar.getnames()


def test_carried_records_are_continued_with_the_options_after_the_commit(tmp_path):
    (tmp_path / "cont").mkdir()
    (tmp_path / "cont" / "suite-qwen2.5-7b.jsonl").write_text("{}\n")
    args, _ = _suite(tmp_path, "qwen2.5-7b", "abc1234", "--other-host", budget="300")
    words = args.split()
    assert words[words.index("--continue") + 1] == "cont/suite-qwen2.5-7b.jsonl"
    assert words[-1] == "--other-host"
    assert 250 <= int(words[words.index("--time-budget") + 1]) <= 300


def test_another_suites_records_are_not_continued(tmp_path):
    (tmp_path / "cont").mkdir()
    (tmp_path / "cont" / "suite-qwen2.5-3b.jsonl").write_text("{}\n")
    args, _ = _suite(tmp_path, "qwen2.5-7b", "abc1234")
    assert "--continue" not in args.split()
