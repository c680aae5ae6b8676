"""Every shared Triton kernel compiles for NVIDIA (sm_90) and AMD (gfx942), without a GPU.

The interpreter (test_triton_kernels.py) checks the math but accepts code the
compiler rejects (loop-carried types, constexpr misuse, block shapes). Here
``triton.compile`` lowers each kernel ahead of time, all the way to a cubin
and an hsaco, with the block sizes and warp counts each vendor's launch table
gives for Llama-3.1-8B shapes and for tiny ones, in BF16 and FP32.

It also compiles every RMSNorm / RoPE variant ``benchmarks/kernels.py --tune``
tries on NVIDIA, so a sweep on the GPU spends no time on launches that cannot build.

Run: ``pytest tests/plugins/test_triton_compile.py`` (about 40 s on 2 CPU cores).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slidekit_kernels.triton_common.vendors import AMD, NVIDIA, LaunchConfig, next_pow2, tune_configs  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process"
)

TARGETS = {"nvidia": GPUTarget("cuda", 90, 32), "amd": GPUTarget("hip", "gfx942", 64)}


def _cases(cfg: LaunchConfig, dt: str) -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(label, kernel, argument types, constexprs, num_warps) as the launchers would choose them."""
    from slidekit_kernels.triton_common import cross_entropy, rms_norm, rope, swiglu

    out: list[tuple[str, object, dict[str, str], dict[str, object], int]] = []
    for hidden in (4096, 123):
        fplan, bplan = (
            rms_norm.forward_plan(8192, hidden, cfg),
            rms_norm.backward_plan(8192, hidden, cfg, 132),
        )
        fwd = {"X": f"*{dt}", "W": f"*{dt}", "Y": f"*{dt}", "RSTD": "*fp32"}
        fwd |= {"stride_x": "i32", "n_rows": "i32", "n_cols": "i32", "eps": "fp32"}
        consts = {"ROWS": fplan.rows, "BLOCK_N": fplan.block_n}
        out.append((f"rms_norm_fwd H{hidden}", rms_norm._rms_norm_fwd_kernel, fwd, consts, fplan.warps))
        bwd = {k: f"*{dt}" for k in ("DY", "X", "W", "DX")} | {"RSTD": "*fp32", "DW_PARTIAL": "*fp32"}
        bwd |= {k: "i32" for k in ("stride_dy", "stride_x", "n_rows", "n_cols", "tiles_per_program")}
        consts = {"ROWS": bplan.rows, "BLOCK_N": bplan.block_n}
        out.append((f"rms_norm_bwd H{hidden}", rms_norm._rms_norm_bwd_kernel, bwd, consts, bplan.warps))
    for hq, hk, d, backward in ((32, 8, 128, False), (32, 8, 128, True), (5, 3, 24, True)):
        plan = rope.launch_plan(8192, hq, hk, d, cfg)
        types = {k: f"*{dt}" for k in ("Q", "K", "QO", "KO", "COS", "SIN")}
        types |= {k: "i32" for k in ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "n_pos", "seq_len")}
        consts = {"N_QH": hq, "N_KH": hk, "HALF": d // 2, "BACKWARD": backward, "BLOCK_P": plan.block_p}
        consts |= {"BLOCK_QH": plan.block_qh, "BLOCK_KH": plan.block_kh, "BLOCK_D": plan.block_d}
        out.append((f"rope {hq}/{hk}x{d}", rope._rope_kernel, types, consts, plan.warps))
    block = cfg.elementwise_block
    types = {"G": f"*{dt}", "U": f"*{dt}", "OUT": f"*{dt}", "n": "i64"}
    out.append(("swiglu_fwd", swiglu._swiglu_fwd_kernel, types, {"BLOCK": block}, cfg.num_warps(block)))
    types = {"DO": f"*{dt}", "G": f"*{dt}", "U": f"*{dt}", "DG": f"*{dt}", "DU": f"*{dt}", "n": "i32"}
    out.append(("swiglu_bwd", swiglu._swiglu_bwd_kernel, types, {"BLOCK": block}, cfg.num_warps(block)))
    for vocab, write_grad in ((128256, True), (123, False)):
        block_v = min(cfg.ce_block, next_pow2(vocab))
        rows = cfg.ce_block // block_v
        types = {"LOGITS": f"*{dt}", "LABELS": "*i64", "LOSS": "*fp32"}
        types |= {k: "i32" for k in ("stride_row", "n_rows", "n_cols", "ignore_index")}
        consts = {"WRITE_GRAD": write_grad, "ROWS": rows, "BLOCK_V": block_v}
        kernel = cross_entropy._cross_entropy_fwd_kernel
        out.append((f"cross_entropy V{vocab}", kernel, types, consts, cfg.num_warps(rows * block_v)))
    return out


def _compile_all(cases: list, vendor: str) -> None:
    failures = []
    for label, kernel, types, consts, warps in cases:
        signature = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs=consts),
                target=TARGETS[vendor],
                options={"num_warps": warps},
            )
        except Exception as exc:  # report every kernel that fails, not just the first
            failures.append(f"{label} ({warps} warps): {exc!r}"[:2000])
            continue
        binary = "cubin" if vendor == "nvidia" else "hsaco"
        assert compiled.asm.get(binary), f"{label}: no {binary} produced"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("cfg", [NVIDIA, AMD], ids=lambda c: c.vendor)
def test_every_kernel_compiles_for_its_vendor(cfg, dt):
    _compile_all(_cases(cfg, dt), cfg.vendor)


def test_every_launch_the_tune_sweep_tries_compiles_for_nvidia():
    """The RMSNorm / RoPE variants of ``benchmarks/kernels.py --tune`` (BF16, Llama shapes), each once."""
    variants: dict[str, tuple] = {}
    for _, cfg in tune_configs(NVIDIA):
        for case in _cases(cfg, "bf16"):
            label, _, _, consts, warps = case
            if label.startswith(("rms_norm", "rope 32/8x128")) and "H123" not in label:
                variants.setdefault(f"{label} {sorted(consts.items())} {warps}", case)
    assert len(variants) >= 30
    _compile_all(list(variants.values()), "nvidia")
