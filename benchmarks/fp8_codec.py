"""The FP8 moment codec against the dynamic-map one: code range on realistic moments, and kernel rates.

    python benchmarks/fp8_codec.py range                 # flush/subnormal fractions per format
    python benchmarks/fp8_codec.py rate --numel 20000000 --repeat 15
    python3 benchmarks/fp8_codec.py rate --numel 233000000 --repeat 5 --threads 16   # the H200 host
    python3 benchmarks/fp8_codec.py build --streams --base DIR   # what that rate loads, built side by side

``range``: 1 M elements in blocks of 256, per-element gradient scale
log-normal within each block (log-sigma 1, 2, 3), 300 AdamW steps (betas 0.9,
0.999); for m, v and r = sqrt(v), each block scaled onto a format's largest
value, the fraction of nonzero elements that round to 0 ("flush"), that fall
below the smallest normal ("subnormal"), and the median relative error of the
nonzero codes. E4M3 and E5M2 through torch's float8 casts, UE4M4 through
``slidekit_optim.fp8``.

``rate``: the three fused CPU kernels (layer_adam's ``fused_adam.cpp``,
adamw_8bit's ``adamw8.cpp``, the FP8 ``adamwfp8.cpp``) on one unit each,
built first, BF16 gradient in, BF16 copy out, weight decay 0.1, moments
made realistic by 5 warm-up steps on log-normal gradients. Then --repeat
rounds, each timing one step of every kernel in turn, at each of --threads
(default 1 and 2: the kernels' thread cap, torch's pool set to the largest),
so background load hits them alike. Prints one JSON line: per kernel and thread count the median
G params/s with min and max, and the ratios ``<faster>_over_<slower>`` of the
FP8 kernel to the others and of adamw_8bit to layer_adam (issue 16 item 2's
target: medians of the per-round ratios, with min and max).

``rate --streams`` adds, in the same rounds, the passes' memory streams without
their arithmetic (``benchmarks/csrc/update_streams.cpp``, built with the
kernels' flags): ``streams_adam_*`` moves layer_adam's 28 B/param,
``streams_fp8_*`` the 8-bit kernels' 16 B/param, each with the BF16 copy
written by plain stores (``plain``, as the kernels write it), by streaming
stores (``nt``), or not at all (``nocopy``). Their rates are each pass's
memory roof on this host; the record adds each kernel's fraction of its roof
and the roofs' ratio, the most any 16 B pass can gain over layer_adam here.

``rate --base DIR`` adds, in the same rounds, the three kernels built from
another copy of ``plugins/slidekit_optim/csrc`` (an earlier commit's:
``git archive REV plugins/slidekit_optim/csrc | tar -x -C DIR``, then
``--base DIR/plugins/slidekit_optim/csrc``) as ``<kernel>_base``, and each
kernel's rate over its base's per round (``<kernel>_over_base``): a change
to a kernel measured A/B on one host, under the same load. A base must hold
the three sources and must not be this tree's own csrc (``base_csrc``).

``build [--streams] [--base DIR]``: builds (or finds in the build cache) every
kernel ``rate`` with the same options loads, one process per source, side by
side, so a timed call does not compile them one after another; one JSON line
with each build's outcome and seconds, exit status 1 if any failed (its
compiler's last lines in the record).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.fp8 import UE4M4, decode, encode
from slidekit_optim.kernel_build import CSRC, load_kernel
from slidekit_optim.layer_adam import LayerAdam, _scalars, _segments
from slidekit_optim.quant8 import BLOCK_SIZE, num_blocks

Step = Callable[[int], None]


# --------------------------------------------------------------------------- range


def _code_stats(x: torch.Tensor, fmt: str) -> dict[str, float]:
    top = {"e4m3": 448.0, "e5m2": 57344.0, "ue4m4": 496.0}[fmt]
    smallest_normal = {"e4m3": 2.0**-6, "e5m2": 2.0**-14, "ue4m4": 2.0**-6}[fmt]
    xb = x.view(-1, BLOCK_SIZE)
    factor = top / xb.abs().amax(1, keepdim=True)
    y = xb * factor
    if fmt == "ue4m4":
        q = decode(encode(y.abs().reshape(-1), UE4M4), UE4M4).view_as(y)
    else:
        q = y.to(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2).float()
    nonzero = xb != 0
    rel = ((q / factor - xb).abs() / xb.abs())[nonzero & (q != 0)]
    return {
        "flush": float(((q == 0) & nonzero).sum() / nonzero.sum()),
        "subnormal": float(((y.abs() < smallest_normal) & nonzero).sum() / nonzero.sum()),
        "median_rel_err": round(float(rel.median()), 4),
    }


def code_range(steps: int = 300, n: int = 1 << 20) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    gen = torch.Generator().manual_seed(0)
    for sigma in (1.0, 2.0, 3.0):
        scale = torch.exp(torch.randn(n, generator=gen) * sigma)
        m, v = torch.zeros(n), torch.zeros(n)
        for _ in range(steps):
            g = scale * torch.randn(n, generator=gen)
            m.mul_(0.9).add_(0.1 * g)
            v.mul_(0.999).add_(0.001 * g * g)
        r = v.sqrt()
        for name, x, fmts in (
            ("m", m, ("e4m3", "e5m2")),
            ("v", v, ("e4m3", "e5m2")),
            ("r", r, ("e4m3", "e5m2", "ue4m4")),
        ):
            for fmt in fmts:
                rows.append({"sigma": sigma, "moment": name, "format": fmt, **_code_stats(x, fmt)})
    return rows


# --------------------------------------------------------------------------- rate

#: The kernels' rates compared per round: (kernel, the kernel it is divided by).
RATIOS = (("adamw_fp8", "adamw_8bit"), ("adamw_fp8", "layer_adam"), ("adamw_8bit", "layer_adam"))


def _warm_grads(n: int, count: int) -> list[torch.Tensor]:
    """BF16 gradients with log-normal per-element scales (log-sigma 1.5): realistic moment spreads."""
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(n, generator=gen) * 1.5) * 1e-3
    return [(scale * torch.randn(n, generator=gen)).to(torch.bfloat16) for _ in range(count)]


def _fp8_step(
    kernel, hyper: OptimizerHyper, n: int, grads: list[torch.Tensor], groups
) -> Callable[[int, int], None]:
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    blocks = num_blocks(n)
    mc, rc = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, ra = torch.zeros(blocks), torch.zeros(blocks)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    segments = _segments(groups, n, 1e-4)
    count = 0

    def step(i: int, threads: int) -> None:
        nonlocal count
        count += 1
        s = _scalars(hyper, 1e-4, count)
        kernel.adamwfp8_step_(
            master,
            grads[i % len(grads)],
            mc,
            ma,
            rc,
            ra,
            lowp,
            [b for _, b, _ in segments],
            [1.0 if d is None else d for _, _, d in segments],
            *s.values(),
            threads,
        )

    return step


def _driver_step(
    factory, hyper: OptimizerHyper, n: int, grads: list[torch.Tensor], groups, thread_counts: tuple[int, ...]
) -> Callable[[int, int], None]:
    opts = {
        t: factory(dataclasses.replace(hyper, threads=t), impl="cpp") for t in thread_counts
    }  # the kernels' cap
    opt = opts[thread_counts[0]]  # any: the state layout does not depend on the thread count
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    lowp = torch.empty(n, dtype=torch.bfloat16)
    count = 0

    def step(i: int, threads: int) -> None:
        nonlocal count
        count += 1
        opts[threads].step(
            master, grads[i % len(grads)], state, lr=1e-4, count=count, groups=groups, lowp_out=lowp
        )

    return step


#: The streams probe's source (see its header).
STREAMS_SOURCE = Path(__file__).resolve().parent / "csrc" / "update_streams.cpp"
#: The probes: name -> (kernel function, copy mode: 0 none, 1 plain stores, 2 streaming stores).
STREAM_PROBES = {
    "streams_adam_plain": ("adam_streams", 1),
    "streams_adam_nt": ("adam_streams", 2),
    "streams_fp8_plain": ("fp8_streams", 1),
    "streams_fp8_nt": ("fp8_streams", 2),
    "streams_fp8_nocopy": ("fp8_streams", 0),
}


def load_streams():
    """Build (or load the cached build of) the streams probe with the kernels' own flags and build lock."""
    return load_kernel(STREAMS_SOURCE, include_dirs=(CSRC,))


def _streams_step(module, probe: str, n: int, grads: list[torch.Tensor]) -> Callable[[int, int], None]:
    fn_name, copy = STREAM_PROBES[probe]
    fn = getattr(module, fn_name)
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    state_dtype = torch.float32 if fn_name == "adam_streams" else torch.uint8
    a, b = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    def step(i: int, threads: int) -> None:
        fn(master, grads[i % len(grads)], a, b, lowp, copy, threads)

    return step


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


#: The three kernels' sources in a csrc directory, by optimizer.
KERNEL_FILES = {"layer_adam": "fused_adam.cpp", "adamw_8bit": "adamw8.cpp", "adamw_fp8": "adamwfp8.cpp"}


def base_csrc(path: Path) -> Path:
    """``path`` as a base for ``rate --base`` / ``build --base``: another copy of the kernels' csrc
    holding their three sources, not this tree's own. ``ValueError`` naming the fix otherwise."""
    if path.resolve() == CSRC:
        raise ValueError(f"{path} is this tree's own csrc: pass another commit's copy")
    missing = [f for f in KERNEL_FILES.values() if not (path / f).is_file()]
    if missing:
        raise ValueError(
            f"{path}: no {', '.join(missing)} there; pass the csrc directory of an earlier commit's "
            "copy (git archive REV plugins/slidekit_optim/csrc | tar -x -C DIR)"
        )
    return path


def _kernel_steps(
    csrc: Path,
    hyper: OptimizerHyper,
    n: int,
    grads: list[torch.Tensor],
    groups,
    thread_counts: tuple[int, ...],
) -> dict[str, Callable[[int, int], None]]:
    """The three kernels built from the sources in ``csrc``, one step function each."""
    drivers = {"layer_adam": LayerAdam, "adamw_8bit": AdamW8bit}
    steps = {
        name: _driver_step(
            functools.partial(cls, kernel_source=csrc / KERNEL_FILES[name]),
            hyper,
            n,
            grads,
            groups,
            thread_counts,
        )
        for name, cls in drivers.items()
    }
    steps["adamw_fp8"] = _fp8_step(load_kernel(csrc / KERNEL_FILES["adamw_fp8"]), hyper, n, grads, groups)
    return steps


def rates(
    n: int, repeat: int, thread_counts: tuple[int, ...], streams: bool = False, base: Path | None = None
) -> dict[str, object]:
    torch.set_num_threads(max(thread_counts))
    hyper = OptimizerHyper(weight_decay=0.1)
    groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    grads = _warm_grads(n, 3)
    steps = _kernel_steps(CSRC, hyper, n, grads, groups, thread_counts)
    if base is not None:
        baseline = _kernel_steps(base_csrc(base), hyper, n, grads, groups, thread_counts)
        steps.update({f"{name}_base": step for name, step in baseline.items()})
    if streams:
        module = load_streams()
        steps.update({probe: _streams_step(module, probe, n, grads) for probe in STREAM_PROBES})
    for step in steps.values():
        for i in range(5):
            step(i, max(thread_counts))
    out: dict[str, object] = {
        "numel": n,
        "repeat": repeat,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # adamw_8bit's decode in this process: gather or permute (timed on first use), portable without AVX-512
        "adamw_8bit_decode": load_kernel(CSRC / KERNEL_FILES["adamw_8bit"]).decode_way(),
    }
    for threads in thread_counts:
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(repeat):
            for name, step in steps.items():
                t0 = time.perf_counter()
                step(r, threads)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            out[f"{name}_{threads}t_gparams_s"] = _spread([n / t / 1e9 for t in ts])
        for name, other in RATIOS:  # > 1: `name` is the faster
            ratio = [b / a for a, b in zip(times[name], times[other], strict=True)]
            out[f"{name}_over_{other}_{threads}t"] = _spread(ratio)
        if streams:
            out.update(_roof_ratios(times, threads))
        if base is not None:
            for name in ("layer_adam", "adamw_8bit", "adamw_fp8"):  # > 1: this tree's kernel is faster
                ratio = [b / a for a, b in zip(times[name], times[f"{name}_base"], strict=True)]
                out[f"{name}_over_base_{threads}t"] = _spread(ratio)
    if base is not None:
        out["base"] = str(base)
    return out


def _roof_ratios(times: dict[str, list[float]], threads: int) -> dict[str, dict[str, float]]:
    """Each kernel's rate over its pass's memory roof (plain-store copy, as the kernels write it), and
    the roofs' ratio: per round, so the same moment of the host's load divides."""

    def per_round(num: str, den: str) -> dict[str, float]:  # rate(num) / rate(den)
        return _spread([b / a for a, b in zip(times[num], times[den], strict=True)])

    return {
        f"layer_adam_of_roof_{threads}t": per_round("layer_adam", "streams_adam_plain"),
        f"adamw_fp8_of_roof_{threads}t": per_round("adamw_fp8", "streams_fp8_plain"),
        f"adamw_8bit_of_roof_{threads}t": per_round("adamw_8bit", "streams_fp8_plain"),
        f"roof_fp8_over_adam_{threads}t": per_round("streams_fp8_plain", "streams_adam_plain"),
        f"roof_fp8_over_adam_nt_{threads}t": per_round("streams_fp8_nt", "streams_adam_nt"),
    }


#: A build child: load_kernel(source, include_dirs=rest) in a process of its own.
_BUILD_CHILD = (
    "import sys; from slidekit_optim.kernel_build import load_kernel; "
    "load_kernel(sys.argv[1], include_dirs=tuple(sys.argv[2:]))"
)


def build(base: Path | None = None, streams: bool = False, timeout: float = 280.0) -> dict[str, object]:
    """Build every kernel ``rate(..., streams=streams, base=base)`` loads, one child process per source,
    all at once (each waits on the kernels' build lock where another process builds the same one); a
    build still running ``timeout`` seconds after they started is killed with its process group (the
    compiler it started too, which would otherwise load the host under the timed rounds and hold the
    output pipe open) and reported. The record: per build its source, whether it succeeded, its seconds, and a failure's last lines."""
    jobs: dict[str, tuple[Path, tuple[Path, ...]]] = {
        name: (CSRC / f, ()) for name, f in KERNEL_FILES.items()
    }
    if base is not None:
        base = base_csrc(base)
        jobs.update({f"{name}_base": (base / f, ()) for name, f in KERNEL_FILES.items()})
    if streams:
        jobs["streams"] = (STREAMS_SOURCE, (CSRC,))
    t0 = time.perf_counter()
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", _BUILD_CHILD, str(src), *map(str, dirs)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a kill takes the compiler it started too
        )
        for name, (src, dirs) in jobs.items()
    }
    built: dict[str, dict[str, object]] = {}
    for name, child in children.items():
        try:
            log, _ = child.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            ok = child.returncode == 0
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            log, ok = child.communicate()[0] + f"\nkilled after {timeout:g} s", False
        entry: dict[str, object] = {"source": str(jobs[name][0]), "ok": ok}
        entry["seconds"] = round(time.perf_counter() - t0, 1)  # since the builds started, all at once
        if not ok:
            entry["log"] = "\n".join((log or "").strip().splitlines()[-6:])
        built[name] = entry
    return {"built": built, "ok": all(e["ok"] for e in built.values())}


def _base_arg(text: str) -> Path:
    try:
        return base_csrc(Path(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("range", "rate", "build"))
    p.add_argument("--numel", type=int, default=20_000_000)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument(
        "--threads",
        default="1,2",
        help="thread counts to measure, comma-separated (torch's pool: the largest)",
    )
    p.add_argument(
        "--streams",
        action="store_true",
        help="rate: also time the passes' memory streams without their arithmetic (each pass's roof); "
        "build: build their probe too",
    )
    p.add_argument(
        "--base",
        type=_base_arg,
        default=None,
        help="rate: also time the kernels built from this copy of another commit's csrc, same rounds; "
        "build: build them too",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=280.0,
        help="build: seconds the builds may take together; one still running then is killed and reported",
    )
    args = p.parse_args()
    if args.what == "build":
        record = build(args.base, streams=args.streams, timeout=args.timeout)
        print(json.dumps(record), flush=True)
        raise SystemExit(0 if record["ok"] else 1)
    if args.what == "range":
        for row in code_range():
            print(json.dumps(row), flush=True)
    else:
        counts = tuple(int(t) for t in args.threads.split(","))
        out = rates(args.numel, args.repeat, counts, streams=args.streams, base=args.base)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
