"""benchmarks/setup_profile.py: the setup of a tiny preset on the CPU, profiled; its JSON line names
the Trainer's construction first (it contains everything else) and the setup's seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _profile(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The script on the tiny preset on the CPU, with ``args`` after the common ones."""
    argv = [sys.executable, "benchmarks/setup_profile.py", "--model", "tiny", "--device", "cpu", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_setup_of_a_tiny_run_is_profiled(tmp_path):
    prof = tmp_path / "setup.prof"
    done = _profile(
        "--batch", "2", "--seq", "32", "--resident", "none", "--top", "5", "--profile-out", str(prof)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert (record["model"], record["batch"], record["resident"]) == ("tiny", 2, "none")
    top = record["top"]
    # Here the Trainer's construction comes first (it contains everything else); on the GPU machine's image
    # (Python 3.12, torch 2.11) the profile lost that frame and a constructor inside it came first (the GPU
    # gate of 2026-12-04): what holds everywhere is that a constructor of the setup leads.
    assert len(top) == 5 and top[0]["function"].endswith("__init__")
    assert 0 < top[0]["cum_s"] <= record["setup_s"] + 0.01
    assert [r["cum_s"] for r in top] == sorted((r["cum_s"] for r in top), reverse=True)
    assert prof.stat().st_size > 0


def test_one_batch_size_only():
    done = _profile("--batch", "2,4", timeout=300)
    assert done.returncode != 0 and "give one batch size" in done.stderr
