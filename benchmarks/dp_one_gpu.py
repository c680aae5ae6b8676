"""Data-parallel slidekit end to end on one machine: N ranks under torchrun (sharing one GPU over gloo, or
the CPU), a checkpoint, a stop, and a resume that continues the run; the single-process run of the same
global batch beside it (issue 18's "done when" on the one-GPU machine).

    python3 benchmarks/dp_one_gpu.py --preset qwen2.5-1.5b --device cuda --out $OUT     # the GPU machine
    python benchmarks/dp_one_gpu.py --preset tiny --device cpu --seq 64 --out /tmp/dp   # anywhere

Model: the preset's shape with random weights (``slidekit.tools.presets``) and the demo tokenizer over the
sample corpus. Run 1: N ranks, ``--steps S1 --checkpoint-every 2``; run 2: the same run directory,
``--steps S2 --resume``; run 3: one process with ``--grad-accum N`` (the same global batch) for S2 steps.
Writes ``dp-summary.json`` (each run's exit status, wall seconds, losses from metrics.jsonl, peak GPU
memory and host RSS where logged) and each run's output under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from slidekit.models.loading import demo_dir
from slidekit.tools.presets import write_config


def _losses(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    keep = (
        "step",
        "loss",
        "grad_norm",
        "tokens_per_s",
        "seconds",
        "host_rss_gib",
        "gpu_mem_gib",
        "t_reduce",
        "t_gather",
    )
    return [{k: r[k] for k in keep if k in r} for r in map(json.loads, path.read_text().splitlines())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--first", type=int, default=4, help="steps of the first run (checkpoint every 2)")
    p.add_argument("--total", type=int, default=6, help="steps after the resume")
    p.add_argument("--resident", default="0.5")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--out", required=True, help="the logs and dp-summary.json")
    p.add_argument(
        "--work",
        default="/tmp/slidekit-dp",
        help="run directories (a 1.5B checkpoint is ~17 GiB: not under --out, which comes back as files)",
    )
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    write_config(args.preset, model, args.seq)
    common = ["--model", str(model), "--random-init", "--tokenizer", str(demo_dir() / "tokenizer")]
    common += ["--device", args.device, "--seq-len", str(args.seq), "--batch-size", str(args.batch)]
    common += ["--gpu-resident", args.resident, "--lr", "1e-4", "--quiet"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += [f"--nproc-per-node={args.ranks}", "-m", "slidekit", "finetune"]
    single = [sys.executable, "-m", "slidekit", "finetune"]
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    dp_dir, one_dir = work / "run-dp", work / "run-one"
    runs = {
        "dp-first": torchrun
        + common
        + ["--run-dir", str(dp_dir), "--steps", str(args.first), "--checkpoint-every", "2", "--keep", "1"],
        "dp-resume": torchrun
        + common
        + ["--run-dir", str(dp_dir), "--steps", str(args.total), "--resume", "--keep", "1"],
        "one-process": single
        + common
        + [
            "--run-dir",
            str(one_dir),
            "--steps",
            str(args.total),
            "--grad-accum",
            str(args.ranks),
            "--keep",
            "1",
        ],
    }
    summary: dict = {"preset": args.preset, "device": args.device, "ranks": args.ranks, "runs": {}}
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    for name, cmd in runs.items():
        if name == "one-process":  # the data-parallel run is done: its checkpoints only take the disk's room
            summary["dp_metrics"] = _losses(dp_dir)
            summary["dp_checkpoints"] = sorted(os.listdir(dp_dir / "checkpoints")) if dp_dir.exists() else []
            shutil.rmtree(dp_dir / "checkpoints", ignore_errors=True)
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
            text = text.decode() if isinstance(text, bytes) else text
        (out / f"{name}.log").write_text(" ".join(cmd) + "\n" + text)
        summary["runs"][name] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "tail": text[-1500:]}
        print(name, rc, summary["runs"][name]["wall_s"], flush=True)
        print(text[-1500:], flush=True)
    summary["one_metrics"] = _losses(one_dir)
    (out / "dp-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("dp_metrics", "one_metrics")}, indent=1))


if __name__ == "__main__":
    main()
