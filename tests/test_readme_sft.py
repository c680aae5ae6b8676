"""README's "complete SFT run", command by command, on the demo model: the dataset directory, two epochs
with eval, TensorBoard, checkpoints, a stop by SIGINT after the first checkpoint, the resume that finishes
and exports. Only the model, the chat file and the sizes are replaced (the demo model is 4 layers of 256
positions); every flag is the README's.

Needs ``datasets`` and ``tensorboard`` (the ``hf`` and ``tensorboard`` extras, both in ``test``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "slidekit" / "resources" / "demo" / "chat.jsonl"
#: What the test replaces in the README's commands: the model, the data file, and sizes for the demo model.
SUBSTITUTE = {
    "/models/Qwen2.5-1.5B-Instruct": "demo",
    "chat.jsonl": str(CHAT),
    "--seq-len 2048": "--seq-len 256",
    "--eval-steps 50": "--eval-steps 5",
    "--save-steps 100": "--save-steps 5",
    "--eval-fraction 0.05": "--eval-fraction 0.1",
}


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("**A complete SFT run**")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, "README's SFT section has no bash block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    commands = [line.split("  #")[0].strip() for line in lines if line.strip()]
    for old, new in SUBSTITUTE.items():
        assert any(old in c for c in commands), f"README's SFT commands no longer hold {old!r}"
        commands = [c.replace(old, new) for c in commands]
    return commands


def _slidekit(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0] == "slidekit"
    return [sys.executable, "-m", "slidekit.cli", *argv[1:]]


@pytest.mark.slow
def test_the_readme_sft_run_trains_evaluates_logs_stops_resumes_and_exports(tmp_path):
    make_data, first, resume, board = _commands()
    assert board.startswith("tensorboard --logdir runs/sft/tensorboard")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    py = shlex.split(make_data)
    subprocess.run([sys.executable, *py[1:]], cwd=tmp_path, env=env, check=True, timeout=300)
    assert (tmp_path / "data" / "chat" / "dataset_info.json").exists()

    # The first run: stopped by SIGINT once its first checkpoint is on disk.
    run = subprocess.Popen(
        _slidekit(first), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = []
    assert run.stdout is not None
    for line in run.stdout:
        seen.append(line)
        if line.startswith("saved checkpoint step 5 ->"):
            run.send_signal(signal.SIGINT)
            break
    rest, _ = run.communicate(timeout=300)
    out = "".join(seen) + rest
    assert run.returncode == 128 + signal.SIGINT, out
    assert re.search(r"run: (\d+) steps = 2 epochs of (\d+) steps", out), out
    assert "step 5: eval loss" in out and "steps per epoch" in out and "\r" not in out
    assert "not exported: the run stopped by SIGINT" in out and not (tmp_path / "out" / "sft").exists()

    done = subprocess.run(
        _slidekit(resume), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    total = int(re.search(r"run: (\d+) steps = 2 epochs", out).group(1))  # type: ignore[union-attr]
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"resumed from step \d+ of {total} ", done.stdout), done.stdout
    assert "exported the model to" in done.stdout

    export = tmp_path / "out" / "sft"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(os.listdir(export))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: set[int] = set()
    for events in (tmp_path / "runs" / "sft" / "tensorboard").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "train/loss" in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars("train/loss")}
    assert steps == set(range(1, total + 1))  # every step once, across the stop and the resume
