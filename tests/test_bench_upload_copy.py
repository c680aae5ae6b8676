"""The bench child's ``--upload-copy`` (``engine.upload_copy``) and ``--update-order``
(``engine.update_order``): passed to the run, said in its record; its ``--repeat-batch`` and ``--lr``,
with which the largest-model runs show a falling loss.

On the CPU the compute dtype is FP32 ("auto"), which refuses upload copies: that record is the
ConfigError's reason and the next run (off) still measures. On the GPU "auto" is BF16 and both run
(NOTES.md 22 has the commands).
"""

from __future__ import annotations

import argparse
import itertools
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


def test_the_update_order_reaches_the_engine_and_the_record_says_what_the_plan_gave(tmp_path):
    assert _config(_args("--update-order", "forward"), "demo").engine.update_order == "forward"
    assert _config(_args(), "demo").engine.update_order == "auto"
    with pytest.raises(SystemExit):
        slidekit_parser().parse_args(["--update-order", "backward"])
    out = tmp_path / "records.jsonl"
    common = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "1"]
    common += ["--warmup", "1", "--resident", "none", "--out", str(out)]
    for order in ("forward", "arrival", "auto"):
        assert main([*common, "--update-order", order]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["update_order"], r["forward_updates"]) for r in records] == [
        ("forward", True),
        ("arrival", False),
        ("auto", False),  # the CPU: no rates, nothing to predict with
    ]


def test_a_repeated_batch_is_the_same_tokens_every_step_and_its_loss_falls(tmp_path):
    """``--repeat-batch``: the largest-model runs show training on one batch (issue 17 allows it)."""
    from slidekit.tools.bench.records import synthetic_tokens

    fresh, repeated = synthetic_tokens(50, 2, 8, 3), synthetic_tokens(50, 2, 8, 3, repeat=True)
    first = [next(fresh) for _ in range(3)]
    again = [next(repeated) for _ in range(3)]
    assert all(a[0].equal(first[0][0]) and a[1].equal(first[0][1]) for a in again)
    assert not first[1][0].equal(first[0][0])  # without it, every step draws new rows
    out = tmp_path / "records.jsonl"
    argv = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "6", "--warmup", "1"]
    argv += ["--resident", "none", "--repeat-batch", "--lr", "3e-3", "--out", str(out)]
    assert main(argv) == 0
    (record,) = (json.loads(line) for line in out.read_text().splitlines())
    assert record["repeat_batch"] is True and record["lr"] == 3e-3
    losses = record["losses"]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
