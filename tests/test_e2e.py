"""The end-to-end job through the command line, on a tiny model: chat data, kill -9, resume, export, report.

``benchmarks/e2e_finetune.py`` is the script that runs the same flow on the H200
for a Qwen2.5-1.5B-sized model; here it runs on the CPU, where the resumed run
must match the uninterrupted one bitwise.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from bench_helpers import load_benchmark


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="slidekit report needs matplotlib")
def test_chat_finetune_killed_resumed_exported_reported(tmp_path):
    module = load_benchmark("e2e_finetune")
    out = tmp_path / "e2e.json"
    code = module.main(
        ["--preset", "tiny", "--device", "cpu", "--work", str(tmp_path / "w"), "--seq", "256", "--batch", "8",
         "--steps", "8", "--kill-after", "3", "--records", "200", "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert code == 0, result["checks"]
    assert result["max_loss_diff"] == 0.0
    assert len(result["losses_b"]) == 8
