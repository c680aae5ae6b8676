"""Kernel benchmark: triton_cuda vs torch_ref vs Liger Kernel, forward + backward, at Llama-3.1-8B shapes.

    python benchmarks/kernels.py                 # on a GPU: BF16, 8192 tokens, hidden 4096, vocab 128256
    python benchmarks/kernels.py --check         # ... and exit 1 if a goal below is missed
    python benchmarks/kernels.py --breakdown     # ... with host_ms and gpu_ms per row (see below)
    python benchmarks/kernels.py --small         # smoke test anywhere; on a CPU the Triton kernels run
                                                 # in the interpreter (this script sets TRITON_INTERPRET=1)
    python benchmarks/kernels.py --tune rms_bwd_elems_per_thread=4 --tune rms_bwd_programs_per_sm=3
                                                 # triton_cuda with other launch sizes (vendors.NVIDIA)
    python benchmarks/kernels.py --tune          # sweep vendors.TUNE_SPACE for RMSNorm and RoPE (~2 min)

The sweep (``--tune`` without a value; ``--tune FIELD=INT`` flags alongside it change the
starting table) measures RMSNorm and RoPE with every point of ``vendors.TUNE_SPACE``, one
group of fields at a time: the RMSNorm backward (rows per loop step, warps, persistent programs
per SM = dW partials), the RMSNorm forward (rows per program, warps), RoPE (positions per
program, warps). One JSON line per configuration, with the launch it produces (rows, warps,
programs) and ``ms`` / ``host_ms`` / ``gpu_ms`` as below, Liger's and the current table's lines
first; then the registers of every compiled variant (``n_regs``, ``resident_per_sm``), the best
point of each group, and the ``--tune`` flags that select them (measured together once more).

Kernels and shapes (Llama-3.1-8B, 8192 tokens): RMSNorm x (8192, 4096); SwiGLU gate/up
(8192, 14336); RoPE q (1, 32, 8192, 128) and k (1, 8, 8192, 128); fused linear +
cross-entropy hidden (8192, 4096), weight (128256, 4096), reduction "sum". Attention is
torch's SDPA in every kernel set, so it is not compared.

Per kernel and implementation, one JSON line: ``ms`` is the median time of one forward +
backward (``triton.testing.do_bench`` on a GPU, wall clock on the CPU): the goal's measure.
At these sizes RMSNorm and RoPE move ~0.3 GB (~80 us on an H200) while a Python autograd
forward + backward costs several hundred microseconds of host time, so ``ms`` is mostly host
overhead; ``--breakdown`` and the sweep add ``host_ms`` (CPU time to issue one step, no sync)
and ``gpu_ms`` (the same step replayed from a CUDA graph: device time alone). ``peak_mib`` the
peak device memory the step allocates beyond its inputs and output gradient; ``scratch_mib``
that peak minus what the step must return (outputs and input gradients), i.e. the working
memory of the implementation; ``rel_err`` the relative L2 error of the forward output
against torch_ref. Liger Kernel joins when ``liger_kernel`` is importable. A table and the
goals follow:

* fused linear + cross-entropy: scratch memory <= 20% of torch_ref's, time <= torch_ref's
  (peak memory cannot meet 20%: the weight gradient alone, V x H in BF16 = 1002 MiB, is
  returned by every implementation and is most of torch_ref's peak);
* every other kernel: time <= Liger's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Impl = Callable[..., Any]


@dataclass(frozen=True)
class Bench:
    """One kernel: how to make its inputs and its implementations."""

    kernel: str
    shape: str
    make_inputs: Callable[[], list[Tensor]]  # leaves; those with requires_grad get gradients
    impls: dict[str, Impl]


def _leaf(
    shape: Sequence[int], dtype: torch.dtype, device: str, *, scale: float = 1.0, shift: float = 0.0
) -> Tensor:
    return (
        (torch.randn(tuple(shape), device=device, dtype=torch.float32) * scale + shift)
        .to(dtype)
        .requires_grad_()
    )


def _liger() -> dict[str, Any] | None:
    """Liger Kernel's public entry points, or None when it is not installed."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return {
        "rms_norm": LigerRMSNormFunction.apply,  # (X, W, eps); Llama casting mode by default
        "swiglu": LigerSiLUMulFunction.apply,
        "rope": liger_rotary_pos_emb,
        "lce": LigerFusedLinearCrossEntropyLoss,
    }


def _rope_tables(t: int, d: int, dtype: torch.dtype, device: str) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    emb = torch.outer(torch.arange(t, dtype=torch.float32, device=device), inv_freq).repeat(1, 2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _shapes(small: bool) -> tuple[int, int, int, int, int, int, int]:
    """Tokens, hidden, intermediate, vocabulary, q heads, kv heads, head dim."""
    return (64, 256, 512, 1000, 4, 2, 32) if small else (8192, 4096, 14336, 128256, 32, 8, 128)


def benches(
    sets: dict[str, Any], liger: dict[str, Any] | None, *, small: bool, dtype: torch.dtype, device: str
) -> list[Bench]:
    n, h, inter, vocab, hq, hk, d = _shapes(small)
    eps = 1e-5
    cos, sin = _rope_tables(n, d, dtype, device)
    out: list[Bench] = []

    impls: dict[str, Impl] = {name: (lambda x, w, ks=ks: ks.rms_norm(x, w, eps)) for name, ks in sets.items()}
    if liger:
        impls["liger"] = lambda x, w: liger["rms_norm"](x, w, eps)
    out.append(
        Bench(
            "rms_norm",
            f"x ({n}, {h})",
            lambda: [
                _leaf((n, h), dtype, device, scale=2.0),
                _leaf((h,), dtype, device, scale=0.1, shift=1.0),
            ],
            impls,
        )
    )

    impls = {name: (lambda g, u, ks=ks: ks.swiglu(g, u)) for name, ks in sets.items()}
    if liger:
        impls["liger"] = liger["swiglu"]
    out.append(
        Bench(
            "swiglu",
            f"gate/up ({n}, {inter})",
            lambda: [_leaf((n, inter), dtype, device), _leaf((n, inter), dtype, device)],
            impls,
        )
    )

    impls = {name: (lambda q, k, ks=ks: ks.rope(q, k, cos, sin)) for name, ks in sets.items()}
    if liger:
        impls["liger"] = lambda q, k: liger["rope"](q, k, cos[None], sin[None])
    out.append(
        Bench(
            "rope",
            f"q (1, {hq}, {n}, {d}), k (1, {hk}, {n}, {d})",
            lambda: [_leaf((1, hq, n, d), dtype, device), _leaf((1, hk, n, d), dtype, device)],
            impls,
        )
    )

    labels = torch.randint(0, vocab, (n,), device=device)
    labels[::7] = -100
    impls = {name: (lambda x, w, ks=ks: ks.linear_cross_entropy(x, w, labels)) for name, ks in sets.items()}
    if liger:
        lce = liger["lce"](ignore_index=-100, reduction="sum")
        impls["liger"] = lambda x, w: lce(w, x, labels)
    out.append(
        Bench(
            "linear_cross_entropy",
            f"hidden ({n}, {h}), weight ({vocab}, {h})",
            lambda: [_leaf((n, h), dtype, device), _leaf((vocab, h), dtype, device, scale=0.02)],
            impls,
        )
    )
    return out


def _step(
    impl: Impl, inputs: list[Tensor], grad_out: list[Tensor] | None
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """One forward + backward; returns the outputs and the input gradients (nothing accumulates in .grad)."""
    out = impl(*inputs)
    outs = (out,) if isinstance(out, Tensor) else tuple(out)
    gouts = grad_out if grad_out is not None else [torch.ones_like(o) for o in outs]
    grads = torch.autograd.grad(outs, [x for x in inputs if x.requires_grad], gouts)
    return outs, grads


def _nbytes(ts: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _time_ms(fn: Callable[[], Any], device: str, repeat: int, *, warmup: int = 100, rep: int = 500) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _host_ms(fn: Callable[[], Any], device: str, calls: int = 20) -> float:
    """Host time to issue one call, without waiting for the device (the launch queue absorbs the work).

    Where the device is far slower than the host (the fused cross-entropy) the queue fills and
    this approaches the device time; for RMSNorm, RoPE and SwiGLU it is the host's own cost.
    """
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - t0) / calls * 1e3
    if device == "cuda":
        torch.cuda.synchronize()
    return ms


def _gpu_ms(fn: Callable[[], Any], device: str) -> tuple[float | None, str | None]:
    """Device time of one call: ``fn`` captured in a CUDA graph and replayed (no host overhead)."""
    if device != "cuda":
        return None, "no GPU"
    import triton.testing

    try:
        ms = float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception as exc:  # capture unsupported by an implementation: report it, keep going
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}"[:200]
    return ms, None


def _breakdown(fn: Callable[[], Any], device: str) -> dict[str, Any]:
    gpu, why = _gpu_ms(fn, device)
    row: dict[str, Any] = {
        "host_ms": round(_host_ms(fn, device), 4),
        "gpu_ms": None if gpu is None else round(gpu, 4),
    }
    if why and device == "cuda":
        row["gpu_ms_error"] = why
    return row


def measure(
    bench: Bench,
    impl_name: str,
    base: list[Tensor],
    reference: Tensor | None,
    device: str,
    repeat: int,
    *,
    breakdown: bool = False,
    memory: bool = True,
    timing: tuple[int, int] = (100, 500),
) -> dict[str, Any]:
    """Time and memory of one implementation on copies of ``base``; ``reference``: torch_ref's output.

    ``breakdown`` adds host_ms and gpu_ms; ``memory`` False skips the peak-memory step;
    ``timing`` is do_bench's (warmup, rep) in ms.
    """
    impl = bench.impls[impl_name]
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in base]
    with torch.no_grad():
        probe = impl(*inputs)
    outs = (probe,) if isinstance(probe, Tensor) else tuple(probe)
    grad_out = [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outs]
    rel_err = None
    if reference is not None:
        rel_err = float(
            (outs[0].float() - reference.float()).norm() / reference.float().norm().clamp(min=1e-30)
        )
    del probe, outs
    _step(impl, inputs, grad_out)  # warm-up: compiles and autotunes
    peak = scratch = None
    if device == "cuda" and memory:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res_outs, res_grads = _step(impl, inputs, grad_out)
        torch.cuda.synchronize()
        peak_bytes = torch.cuda.max_memory_allocated() - allocated
        peak, scratch = peak_bytes / 2**20, (peak_bytes - _nbytes(res_outs) - _nbytes(res_grads)) / 2**20
        del res_outs, res_grads

    def step() -> None:
        _step(impl, inputs, grad_out)

    ms = _time_ms(step, device, repeat, warmup=timing[0], rep=timing[1])
    row = {
        "kernel": bench.kernel,
        "impl": impl_name,
        "shape": bench.shape,
        "dtype": str(inputs[0].dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "ms": round(ms, 4),
        "peak_mib": None if peak is None else round(peak, 1),
        "scratch_mib": None if scratch is None else round(scratch, 1),
        "rel_err": None if rel_err is None else float(f"{rel_err:.3g}"),
    }
    if breakdown:
        row |= _breakdown(step, device)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    by = {(r["kernel"], r["impl"]): r for r in rows}
    extra = [k for k in ("host_ms", "gpu_ms") if any(k in r for r in rows)]  # --breakdown
    head: tuple[str, ...] = ("kernel", "impl", "ms", "x torch_ref", "x liger", "peak MiB", "scratch MiB")
    head += ("rel err", *(k.replace("_", " ") for k in extra))
    lines = [head]

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        ref, lig = by.get((r["kernel"], "torch_ref")), by.get((r["kernel"], "liger"))
        lines.append(
            (
                r["kernel"],
                r["impl"],
                f"{r['ms']:.3f}",
                f"{r['ms'] / ref['ms']:.2f}" if ref else "-",
                f"{r['ms'] / lig['ms']:.2f}" if lig else "-",
                fmt(r["peak_mib"], ".0f"),
                fmt(r["scratch_mib"], ".0f"),
                fmt(r["rel_err"], ".1e"),
                *(fmt(r.get(k), ".3f") for k in extra),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def goals(rows: list[dict[str, Any]], candidate: str) -> list[tuple[str, bool | None]]:
    """The lead's goals for ``candidate``: (sentence, met?); None where it cannot be judged here."""
    by = {(r["kernel"], r["impl"]): r for r in rows}
    out: list[tuple[str, bool | None]] = []
    ce, ce_ref = by.get(("linear_cross_entropy", candidate)), by.get(("linear_cross_entropy", "torch_ref"))
    if ce and ce_ref:
        if ce["scratch_mib"] is not None and ce_ref["scratch_mib"]:
            share = ce["scratch_mib"] / ce_ref["scratch_mib"]
            out.append(
                (f"linear_cross_entropy scratch {share:.0%} of torch_ref's (goal <= 20%)", share <= 0.2)
            )
        else:
            out.append(("linear_cross_entropy memory: measured on a GPU only", None))
        ratio = ce["ms"] / ce_ref["ms"]
        out.append((f"linear_cross_entropy time {ratio:.2f}x torch_ref's (goal <= 1)", ratio <= 1.0))
    for kernel in ("rms_norm", "swiglu", "rope"):
        mine, lig = by.get((kernel, candidate)), by.get((kernel, "liger"))
        if mine and lig:
            ratio = mine["ms"] / lig["ms"]
            out.append((f"{kernel} time {ratio:.2f}x Liger's (goal <= 1)", ratio <= 1.0))
        elif mine:
            out.append((f"{kernel} vs Liger: liger_kernel is not installed", None))
    return out


def _launch_table(overrides: list[str], parser: argparse.ArgumentParser) -> Any:
    """The NVIDIA launch table with the ``--tune FIELD=INT`` overrides applied (validated)."""
    import dataclasses

    from slidekit_kernels.triton_common.vendors import NVIDIA

    fields = {f.name for f in dataclasses.fields(NVIDIA)} - {"vendor"}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields or not value.isdigit():
            parser.error(f"--tune {item!r}: expected FIELD=INT with FIELD one of {', '.join(sorted(fields))}")
        changes[key] = int(value)
    try:
        return dataclasses.replace(NVIDIA, **changes)
    except ValueError as exc:
        parser.error(f"--tune: {exc}")


# --------------------------------------------------------------------------- the launch-size sweep

#: Which kernel each group of vendors.TUNE_SPACE launches.
_GROUP_KERNEL = {"rms_norm backward": "rms_norm", "rms_norm forward": "rms_norm", "rope": "rope"}


def _launch_sizes(kernel: str, cfg: Any, small: bool, device: str) -> dict[str, int]:
    """What ``cfg`` launches for ``kernel`` at the benchmark's shapes (rows, warps, programs)."""
    from slidekit_kernels.triton_common import rms_norm, rope
    from slidekit_kernels.triton_common._launch import multiprocessors

    n, h, _, _, hq, hk, d = _shapes(small)
    if kernel == "rms_norm":
        f = rms_norm.forward_plan(n, h, cfg)
        b = rms_norm.backward_plan(n, h, cfg, multiprocessors(torch.device(device)))
        fwd = {"fwd_rows": f.rows, "fwd_warps": f.warps, "fwd_programs": f.programs}
        bwd = {"bwd_rows_per_step": b.rows, "bwd_warps": b.warps, "bwd_programs": b.programs}
        return fwd | bwd | {"bwd_rows_per_program": b.rows * b.steps}
    r = rope.launch_plan(n, hq, hk, d, cfg)
    return {"positions_per_program": r.block_p, "warps": r.warps, "programs": r.programs}


def _compiled_variants() -> list[dict[str, Any]]:
    """Registers and occupancy of every compiled RMSNorm / RoPE variant (triton internals: best effort)."""
    from slidekit_kernels.triton_common import rms_norm, rope

    out: list[dict[str, Any]] = []
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    for fn in (rms_norm._rms_norm_fwd_kernel, rms_norm._rms_norm_bwd_kernel, rope._rope_kernel):
        for entry in getattr(fn, "device_caches", {}).values():
            for compiled in list(entry[0].values()):
                try:
                    compiled = compiled.result() if hasattr(compiled, "result") else compiled
                    consts = {
                        fn.arg_names[k[0]]: getattr(v, "value", v) for k, v in compiled.src.constants.items()
                    }
                    warps, n_regs = compiled.metadata.num_warps, compiled.n_regs
                    per_warp = -(-n_regs * 32 // 256) * 256  # registers are allocated per warp, in 256s
                    resident = min(regs_per_sm // max(1, per_warp * warps), threads_per_sm // (32 * warps))
                    row = {"variant": fn.__name__, "constexprs": consts, "num_warps": warps, "n_regs": n_regs}
                    out.append(row | {"n_spills": compiled.n_spills, "resident_per_sm": resident})
                except Exception as exc:  # internals differ across triton versions: say so, go on
                    out.append({"variant": fn.__name__, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return out


def sweep(args: argparse.Namespace, parser: argparse.ArgumentParser, ref: Any, device: str) -> int:
    """Measure RMSNorm and RoPE at every point of vendors.TUNE_SPACE; print the best and its flags."""
    import dataclasses

    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet
    from slidekit_kernels.triton_common.vendors import NVIDIA, TUNE_SPACE, tune_configs

    table = _launch_table([t for t in args.tune if t != "sweep"], parser)
    dtype = torch.float32 if device == "cpu" else getattr(torch, args.dtype)
    liger = None if args.no_liger or device == "cpu" else _liger()

    def bench(kernel: str, cfg: Any) -> Bench:
        """torch_ref and Liger (cfg None) or triton_cuda with the launch table ``cfg``, for ``kernel``."""
        sets = {"torch_ref": ref} if cfg is None else {"triton_cuda": TritonKernelSet("triton_cuda", cfg)}
        found = benches(sets, liger if cfg is None else None, small=args.small, dtype=dtype, device=device)
        return next(b for b in found if b.kernel == kernel)

    def run(kernel: str, inputs: list[Tensor], reference: Tensor, impl: str, cfg: Any, **extra: Any) -> Any:
        row: dict[str, Any] = {"kernel": kernel, "impl": impl}
        try:  # one bad point must not end the sweep
            b = bench(kernel, cfg)
            row = measure(b, "liger" if cfg is None else "triton_cuda", inputs, reference, device, args.repeat,
                          breakdown=True, memory=False, timing=(25, 200)) | {"impl": impl}  # fmt: skip
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if cfg is not None:
            row |= extra | {"launch": _launch_sizes(kernel, cfg, args.small, device)}
        print(json.dumps(row, default=str), flush=True)
        return row

    def inputs_and_reference(kernel: str) -> tuple[list[Tensor], Tensor]:
        b = bench(kernel, None)
        inputs = b.make_inputs()
        with torch.no_grad():
            out = b.impls["torch_ref"](*inputs)
        return inputs, out if isinstance(out, Tensor) else out[0]

    torch.manual_seed(0)
    best: dict[str, dict[str, Any]] = {}
    for kernel in ("rms_norm", "rope"):
        inputs, reference = inputs_and_reference(kernel)
        if liger:
            run(kernel, inputs, reference, "liger", None)
        table_ms = run(kernel, inputs, reference, "triton_cuda (table)", table, group="table").get("ms", 1e9)
        seen = set()
        for group, cfg in tune_configs(table):
            launch = _launch_sizes(kernel, cfg, args.small, device)
            if _GROUP_KERNEL[group] != kernel or (group, str(launch)) in seen:
                continue  # another kernel's group, or a point launching like one already measured
            seen.add((group, str(launch)))
            row = run(kernel, inputs, reference, "triton_cuda", cfg, group=group,
                      config={f: getattr(cfg, f) for f in TUNE_SPACE[group]})  # fmt: skip
            ok = "ms" in row and row["rel_err"] < 2e-2
            if ok and row["ms"] < best.get(group, {}).get("ms", table_ms):
                best[group] = row
        del inputs, reference

    if device == "cuda":
        for variant in _compiled_variants():
            print(json.dumps(variant, default=str), flush=True)
    changes: dict[str, Any] = {}
    for group, row in best.items():
        print(f"# best {group}: {row['ms']:.4f} ms with {row['config']} ({row['launch']})")
        changes |= row["config"]
    tuned = dataclasses.replace(table, **changes)
    flags = " ".join(
        f"--tune {k}={v}" for k, v in dataclasses.asdict(tuned).items() if getattr(NVIDIA, k) != v
    )
    print(
        f"# the best points together: python3 benchmarks/kernels.py {flags or '(the NVIDIA table as it is)'}"
    )
    for kernel in ("rms_norm", "rope"):  # measured together once more, beside Liger
        inputs, reference = inputs_and_reference(kernel)
        if liger:
            run(kernel, inputs, reference, "liger", None)
        run(kernel, inputs, reference, "triton_cuda (best)", tuned, group="best", config=changes)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="small shapes: a smoke test that runs anywhere")
    p.add_argument("--sets", default="torch_ref,triton_cuda", help="kernel sets to compare, comma-separated")
    p.add_argument("--no-liger", action="store_true", help="leave Liger Kernel out even if installed")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions on the CPU (GPU: do_bench)")
    p.add_argument("--check", action="store_true", help="exit 1 if a goal is missed (GPU runs)")
    p.add_argument(
        "--tune",
        action="append",
        nargs="?",
        const="sweep",
        default=[],
        metavar="FIELD=INT",
        help="override a LaunchConfig field of triton_cuda (repeatable), e.g. rms_bwd_programs_per_sm=3; "
        "alone: sweep the RMSNorm / RoPE launch sizes (vendors.TUNE_SPACE)",
    )
    p.add_argument("--breakdown", action="store_true", help="add host_ms and gpu_ms (CUDA graph) per row")
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if not args.small:
            p.error("without a GPU only --small runs (the Triton kernels are interpreted on the CPU)")
        # Before any Triton kernel is defined: on the CPU they can only run interpreted.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.float32 if device == "cpu" else getattr(torch, args.dtype)  # interpreter: float32 only

    from slidekit import Plugins  # after TRITON_INTERPRET is settled: the kernel sets import triton lazily

    plugins = Plugins()
    sets = {name: plugins.get("kernels", name).descriptor.factory() for name in args.sets.split(",")}
    if "torch_ref" not in sets:
        p.error("--sets must include torch_ref, the baseline")
    if "sweep" in args.tune:
        return sweep(args, p, sets["torch_ref"], device)
    if args.tune:
        from slidekit_kernels.triton_common.kernel_set import TritonKernelSet

        table = _launch_table(args.tune, p)
        print(f"# triton_cuda launch table: {table}")
        sets["triton_cuda"] = TritonKernelSet("triton_cuda", table)
    liger = None if args.no_liger or device == "cpu" else _liger()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for bench in benches(sets, liger, small=args.small, dtype=dtype, device=device):
        base = bench.make_inputs()
        with torch.no_grad():
            ref_out = bench.impls["torch_ref"](*base)
        reference = ref_out if isinstance(ref_out, Tensor) else ref_out[0]
        for name in bench.impls:
            row = measure(
                bench, name, base, None if name == "torch_ref" else reference, device, args.repeat,
                breakdown=args.breakdown,
            )  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
        del base, ref_out, reference
    if liger is None:
        print("# liger_kernel is not installed (or --no-liger / CPU): Liger columns are empty")
    print(_table(rows))
    missed = False
    for name in sets:
        if name == "torch_ref":
            continue
        for sentence, ok in goals(rows, name):
            if device == "cpu":
                ok = None  # interpreted kernels: times say nothing about the GPU
            print(f"{name}: {sentence}: {'not judged' if ok is None else 'met' if ok else 'MISSED'}")
            missed |= ok is False
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
