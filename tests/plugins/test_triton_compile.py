"""Every shared Triton kernel compiles for NVIDIA (sm_90) and AMD (gfx942), without a GPU.

The interpreter (test_triton_kernels.py) checks the math but accepts code the
compiler rejects (loop-carried types, constexpr misuse, block shapes). Here
``triton.compile`` lowers each kernel ahead of time, all the way to a cubin
and an hsaco, with the block sizes and warp counts each vendor's launch table
gives for Llama-3.1-8B shapes and for tiny ones, in BF16 and FP32.

Run: ``pytest tests/plugins/test_triton_compile.py`` (about 20 s on 2 CPU cores).
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slidekit_kernels.triton_common.vendors import AMD, NVIDIA, LaunchConfig, next_pow2, prev_pow2  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process"
)

TARGETS = {"nvidia": GPUTarget("cuda", 90, 32), "amd": GPUTarget("hip", "gfx942", 64)}


def _cases(cfg: LaunchConfig, dt: str) -> list[tuple[str, object, dict[str, str], dict[str, object], int]]:
    """(label, kernel, argument types, constexprs, num_warps) as the launchers would choose them."""
    from slidekit_kernels.triton_common import cross_entropy, rms_norm, rope, swiglu

    out: list[tuple[str, object, dict[str, str], dict[str, object], int]] = []
    for hidden in (4096, 123):
        block = next_pow2(hidden)
        rows = cfg.rows_per_tile(block)
        consts = {"ROWS": rows, "BLOCK_N": block}
        fwd = {"X": f"*{dt}", "W": f"*{dt}", "Y": f"*{dt}", "RSTD": "*fp32"}
        fwd |= {"stride_x": "i32", "stride_y": "i32", "n_rows": "i32", "n_cols": "i32", "eps": "fp32"}
        out.append(
            (
                f"rms_norm_fwd H{hidden}",
                rms_norm._rms_norm_fwd_kernel,
                fwd,
                consts,
                cfg.num_warps(rows * block),
            )
        )
        bwd = {
            "DY": f"*{dt}",
            "X": f"*{dt}",
            "W": f"*{dt}",
            "RSTD": "*fp32",
            "DX": f"*{dt}",
            "DW_PARTIAL": "*fp32",
        }
        bwd |= {
            k: "i32" for k in ("stride_dy", "stride_x", "stride_dx", "n_rows", "n_cols", "tiles_per_program")
        }
        out.append(
            (
                f"rms_norm_bwd H{hidden}",
                rms_norm._rms_norm_bwd_kernel,
                bwd,
                consts,
                cfg.num_warps(rows * block),
            )
        )
    for hq, hk, d, backward in ((32, 8, 128, False), (4, 2, 24, True)):
        per_position = 2 * (next_pow2(hq) + next_pow2(hk)) * next_pow2(d // 2)
        block_p = prev_pow2(max(1, cfg.row_tile // per_position))
        types = {k: f"*{dt}" for k in ("Q", "K", "QO", "KO", "COS", "SIN")}
        types |= {k: "i32" for k in ("sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t", "n_pos", "seq_len")}
        types |= {"n_q_heads": "i32", "n_k_heads": "i32", "half": "i32"}
        consts = {
            "BACKWARD": backward,
            "BLOCK_P": block_p,
            "BLOCK_QH": next_pow2(hq),
            "BLOCK_KH": next_pow2(hk),
        }
        consts["BLOCK_D"] = next_pow2(d // 2)
        out.append(
            (
                f"rope {hq}/{hk}x{d}",
                rope._rope_fwd_kernel,
                types,
                consts,
                cfg.num_warps(block_p * per_position),
            )
        )
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


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("cfg", [NVIDIA, AMD], ids=lambda c: c.vendor)
def test_every_kernel_compiles_for_its_vendor(cfg, dt):
    failures = []
    for label, kernel, types, consts, warps in _cases(cfg, dt):
        signature = {name: "constexpr" if name in consts else types[name] for name in kernel.arg_names}
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs=consts),
                target=TARGETS[cfg.vendor],
                options={"num_warps": warps},
            )
        except Exception as exc:  # report every kernel that fails, not just the first
            failures.append(f"{label} ({warps} warps): {exc!r}"[:2000])
            continue
        binary = "cubin" if cfg.vendor == "nvidia" else "hsaco"
        assert compiled.asm.get(binary), f"{label}: no {binary} produced"
    assert not failures, "\n".join(failures)
