"""A real fine-tune, end to end, through the command line: the job a user runs, killed and resumed.

    python benchmarks/e2e_finetune.py --preset qwen2.5-1.5b --work /tmp/e2e --out e2e.json   # on the H200
    python benchmarks/e2e_finetune.py --preset tiny --device cpu --work /tmp/e2e              # anywhere

1. writes a random-weight model of the preset's shape to disk as a Hugging Face
   directory (config, safetensors, the demo tokenizer), through slidekit's export;
2. writes a chat-format JSONL file (the demo conversations, repeated);
3. runs ``slidekit finetune`` on it without interruption (run A);
4. runs the same command again (run B, with ``--trace``), SIGKILLs it as soon as
   its checkpoint of step ``--kill-after`` exists, and resumes it with
   ``--resume --export``;
5. reloads the export with ``transformers.AutoModelForCausalLM`` and compares its
   logits with slidekit's own forward pass on the exported weights;
6. draws ``slidekit report`` of run B.

Prints (and writes to ``--out``) one JSON object: per-step losses of A and B,
their largest difference (0 on the CPU, where runs are bitwise reproducible),
the logits difference, the step the kill happened after, file sizes and
timings. Exit status 1 if any check fails. ``tests/test_e2e.py`` runs it on a
tiny model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from slidekit import EngineConfig, ModelConfig, TrainConfig, Trainer
from slidekit.models.loading import demo_dir
from slidekit.tools.presets import write_config
from slidekit.tools.report import load_metrics


def make_model(preset: str, directory: Path, seq: int, device: str) -> float:
    """A random-weight model directory; returns seconds taken."""
    t0 = time.perf_counter()
    shape = directory.with_name(directory.name + "-config")
    write_config(preset, shape, seq)
    for f in (demo_dir() / "tokenizer").iterdir():
        shutil.copy(f, shape / f.name)
    cfg = TrainConfig(
        model=ModelConfig(source=str(shape), random_init=True),
        engine=EngineConfig(device=device, gpu_resident="none"),
    )
    with Trainer(cfg) as trainer:
        trainer.export(str(directory), dtype="bfloat16", overwrite=True)
    return time.perf_counter() - t0


def make_data(path: Path, records: int) -> None:
    lines = (demo_dir() / "chat.jsonl").read_text(encoding="utf-8").splitlines()
    with path.open("w", encoding="utf-8") as f:
        for i in range(records):
            f.write(lines[i % len(lines)] + "\n")


def finetune(args: argparse.Namespace, model: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "slidekit.cli", "finetune",
        "--model", str(model), "--data", str(data), "--data-format", "chat", "--completion-only",
        "--seq-len", str(args.seq), "--batch-size", str(args.batch), "--steps", str(args.steps),
        "--lr", "1e-4", "--schedule", "cosine", "--warmup-steps", "2", "--max-grad-norm", "1.0",
        "--eval-fraction", "0.05", "--eval-every", str(args.kill_after),
        "--device", args.device, "--run-dir", str(run), "--checkpoint-every", str(args.kill_after),
        "--keep", "1", "--quiet", *extra,
    ]  # fmt: skip


def losses(run: Path) -> dict[int, float]:
    """Loss per step of a run directory (a torn last line, as a kill leaves, is skipped)."""
    return {int(row["step"]): float(row["loss"]) for row in load_metrics(run)}


def run_killed(cmd: list[str], run: Path, after: int, timeout: float) -> int:
    """Start ``cmd``, SIGKILL it once the checkpoint of step ``after`` is complete; the step it was killed at."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    target = run / "checkpoints" / f"step-{after:08d}"
    deadline = time.monotonic() + timeout
    while not target.exists():
        if proc.poll() is not None:
            if target.exists():  # it wrote the checkpoint (and ran to its end) between the two checks
                break
            raise RuntimeError(
                f"the run ended before its checkpoint of step {after}: {proc.stderr.read()[-2000:]}"
            )  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"no checkpoint of step {after} within {timeout} s")
        time.sleep(0.05)
    proc.kill()  # SIGKILL; nothing if it has already ended and been reaped (no stray pid is signalled)
    proc.wait()
    return max(losses(run)) if (run / "metrics.jsonl").exists() else 0


def compare_logits(export: Path, device: str, seq: int) -> float:
    """Largest |logit difference| between transformers and slidekit's forward on the exported weights."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 1000, (1, min(seq, 64)), generator=torch.Generator().manual_seed(0))
    dtype = torch.float32
    model = AutoModelForCausalLM.from_pretrained(export, dtype=dtype).to(device)
    with torch.no_grad():
        theirs = model(ids.to(device)).logits.float().cpu()
    del model
    cfg = TrainConfig(
        model=ModelConfig(source=str(export)),
        engine=EngineConfig(device=device, compute_dtype="float32", gpu_resident="none"),
    )
    with Trainer(cfg) as trainer:
        ours = trainer.engine.forward(ids)
    return float((theirs - ours).abs().max() / theirs.abs().max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--work", required=True, help="scratch directory (emptied first)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-after", type=int, default=6)
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args(argv)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model, data = work / "model", work / "chat.jsonl"
    result: dict[str, Any] = {"preset": args.preset, "device": args.device}
    result["make_model_s"] = round(make_model(args.preset, model, args.seq, args.device), 1)
    result["model_bytes"] = sum(f.stat().st_size for f in model.iterdir())
    make_data(data, args.records)

    t0 = time.perf_counter()
    a = subprocess.run(
        finetune(args, model, data, work / "a"), capture_output=True, text=True, timeout=args.timeout
    )
    result["run_a_s"] = round(time.perf_counter() - t0, 1)
    if a.returncode:
        raise RuntimeError(f"run A failed ({a.returncode}): {a.stderr[-3000:]}")
    shutil.rmtree(work / "a" / "checkpoints")  # only its metrics are compared; a 1.5B checkpoint is 18 GB

    run_b = work / "b"
    cmd_b = finetune(args, model, data, run_b, "--trace", str(run_b / "trace.json"))
    result["killed_at_step"] = run_killed(cmd_b, run_b, args.kill_after, args.timeout)
    t0 = time.perf_counter()
    export = work / "export"
    b = subprocess.run(
        [*cmd_b, "--resume", "--export", str(export)], capture_output=True, text=True, timeout=args.timeout
    )
    result["run_b_resume_s"] = round(time.perf_counter() - t0, 1)
    if b.returncode:
        raise RuntimeError(f"the resumed run failed ({b.returncode}): {b.stderr[-3000:]}")
    la, lb = losses(work / "a"), losses(run_b)
    result["losses_a"] = [la[k] for k in sorted(la)]
    result["losses_b"] = [lb[k] for k in sorted(lb)]
    result["max_loss_diff"] = max(abs(la[k] - lb[k]) for k in la) if sorted(la) == sorted(lb) else None

    result["export_logits_rel_diff"] = compare_logits(export, args.device, args.seq)
    r = subprocess.run(
        [sys.executable, "-m", "slidekit.cli", "report", str(run_b)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    png = run_b / "report.png"
    result["report_bytes"] = png.stat().st_size if png.exists() else 0
    result["trace_bytes"] = (run_b / "trace.json").stat().st_size if (run_b / "trace.json").exists() else 0
    checks = {
        "all steps logged once": sorted(lb) == list(range(1, args.steps + 1)),
        "losses match the uninterrupted run": result["max_loss_diff"] is not None
        and result["max_loss_diff"] <= (0.0 if args.device == "cpu" else 2e-2),
        "export reloads with the same logits": result["export_logits_rel_diff"] < 1e-4,
        "report drawn": r.returncode == 0 and result["report_bytes"] > 0,
        "trace written": result["trace_bytes"] > 0,
    }
    result["checks"] = checks
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
