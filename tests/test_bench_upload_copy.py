"""The bench child's ``--upload-copy`` (``engine.upload_copy``): passed to the run, said in its record.

On the CPU the compute dtype is FP32 ("auto"), which refuses upload copies: that record is the
ConfigError's reason and the next run (off) still measures. On the GPU "auto" is BF16 and both run
(NOTES.md 22 has the commands).
"""

from __future__ import annotations

import argparse
import json

import pytest

from slidekit.tools.bench.slidekit_run import _config, main, slidekit_parser


def _args(*argv: str) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(slidekit_parser().parse_args(argv)), "batch": 2})  # main's, per batch


def test_the_flag_reaches_the_engine_config():
    assert _config(_args("--upload-copy", "on"), "demo").engine.upload_copy == "on"
    assert _config(_args(), "demo").engine.upload_copy == "off"
    with pytest.raises(SystemExit):
        slidekit_parser().parse_args(["--upload-copy", "yes"])


def test_the_record_says_it(tmp_path):
    out = tmp_path / "records.jsonl"
    common = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "1"]
    common += ["--warmup", "1", "--resident", "none", "--out", str(out)]
    assert main([*common, "--upload-copy", "on"]) == 1  # nothing ran: FP32 on the CPU
    assert main([*common, "--upload-copy", "off"]) == 0
    on, off = (json.loads(line) for line in out.read_text().splitlines())
    assert on["status"] == "unavailable" and "engine.compute_dtype='bfloat16'" in on["reason"]
    assert off["status"] == "ok" and off["upload_copy"] == "off"
