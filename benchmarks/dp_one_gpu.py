"""Data-parallel slidekit end to end on one machine: N ranks under torchrun (sharing one GPU over gloo, or
the CPU), a checkpoint, a stop, and a resume that continues the run; the single-process run of the same
global batch beside it (issue 18's "done when" on the one-GPU machine).

    python3 benchmarks/dp_one_gpu.py --preset qwen2.5-1.5b --device cuda --out $OUT     # the GPU machine
    python benchmarks/dp_one_gpu.py --preset tiny --device cpu --seq 64 --out /tmp/dp   # anywhere

Model: the preset's shape with random weights (``slidekit.tools.presets``) and the demo tokenizer over the
sample corpus. Run 1: N ranks, ``--steps S1 --checkpoint-every 2``; run 2: the same run directory,
``--steps S2 --resume``; run 3: one process with ``--grad-accum N`` (the same global batch) for S2 steps.
Writes ``dp-summary.json`` (each run's exit status, wall seconds, losses from metrics.jsonl, peak GPU
memory and host RSS where logged, and ``comparison``: each step's loss and gradient norm against the
single process's, within ``LOSS_RTOL`` / ``NORM_RTOL``) and each run's output under --out. Exits 1
when a run failed or a step disagrees, naming the steps.

Test: ``pytest tests/test_dp_one_gpu.py``.
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


#: How far a data-parallel step may be from the single-process step of the same global batch: the loss to
#: BF16 rounding of a differently ordered reduction, the gradient norm a little more (a sum of squares of
#: BF16 gradients taken shard by shard). Measured on the H200 (1.5B, 2 ranks): losses <= 1.2e-4 and norms
#: <= 0.5 % where they agreed; the resident-norm race of 2026-12-02 put two norms 10 % and 39 % off.
LOSS_RTOL = 1e-3
NORM_RTOL = 0.03


def compare(dp: list[dict], one: list[dict]) -> dict:
    """Step by step, the data-parallel run's loss and gradient norm against the single process's: the
    relative differences, the steps outside ``LOSS_RTOL`` / ``NORM_RTOL``, and whether every step of
    the single run has its data-parallel twin."""
    by_step = {r["step"]: r for r in dp}
    rows, off, missing = [], [], []
    for ref in one:
        twin = by_step.get(ref["step"])
        if twin is None:
            missing.append(ref["step"])
            continue
        row = {"step": ref["step"]}
        for key, tol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
            a, b = twin.get(key), ref.get(key)
            if a is None or b is None:
                continue
            rel = abs(a - b) / abs(b) if b else abs(a - b)
            row[key] = round(rel, 6)
            if not rel <= tol:  # NaN is off too
                off.append({"step": ref["step"], "what": key, "dp": a, "one": b, "rel": rel})
        rows.append(row)
    agree = bool(one) and not off and not missing
    return {"agree": agree, "loss_rtol": LOSS_RTOL, "norm_rtol": NORM_RTOL, "steps": rows, "off": off,
            "missing_steps": missing}  # fmt: skip


def main() -> int:
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
    summary["comparison"] = compare(summary["dp_metrics"], summary["one_metrics"])
    ok = summary["comparison"]["agree"] and all(r["rc"] == 0 for r in summary["runs"].values())
    (out / "dp-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("dp_metrics", "one_metrics", "comparison")}, indent=1))
    print(f"dp_one_gpu: {'AGREE' if ok else 'DISAGREE'}: {summary['comparison']['off'] or 'every step in tolerance'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

