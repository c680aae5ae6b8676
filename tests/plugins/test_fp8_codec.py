"""The FP8 moment codec (slidekit_optim/fp8.py) and the feasibility kernel csrc/adamwfp8.cpp.

The codec: E4M3 equals torch's ``float8_e4m3fn`` on every code and on every
midpoint and its neighbours; UE4M4 has 256 increasing values and encodes to
the nearest, ties to the even code; keep_nonzero. The kernel: its encoder and
decoder equal the torch codec on the same inputs, and its whole step equals
``fp8.reference_step`` bit for bit (master, BF16 copy, codes, scales) over
several steps from an all-zero state: unit sizes below, at and off the block
size, FP32 and BF16 gradients, weight-decay groups with different decays and
a range in none, a block whose gradient is always zero, 1 and 2 threads, with
and without the BF16 copy; and under the DEFAULT ATen capability too (the
portable loops, built for it in a subprocess).

Run: ``pytest tests/plugins/test_fp8_codec.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fp8_inputs import _groups, _inputs

from slidekit.interfaces import OptimizerHyper
from slidekit_optim.fp8 import E4M3, STATE_KEYS, UE4M4, decode, encode, reference_step
from slidekit_optim.kernel_build import CSRC, kernel_status, load_kernel
from slidekit_optim.layer_adam import _scalars, _segments
from slidekit_optim.quant8 import BLOCK_SIZE, num_blocks

SOURCE = CSRC / "adamwfp8.cpp"
HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8)
LR = 1e-3


@pytest.fixture(scope="module")
def kernel():
    status = kernel_status(SOURCE)
    if status.startswith(("pure torch (no C++ compiler", "pure torch (ninja")):
        pytest.skip(status)
    return load_kernel(SOURCE)


@pytest.fixture
def csrc_copy(tmp_path) -> Path:
    """Another copy of the kernels' csrc, as ``rate --base`` / ``build --base`` take one."""
    shutil.copytree(CSRC, tmp_path / "csrc")
    return tmp_path / "csrc"


def _values(fmt) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8)
    if fmt.signed:
        codes = codes[(codes & 0x7F) != 0x7F]  # E4M3's NaN codes are never produced
    return decode(codes, fmt)


def _probes(fmt, n: int = 200_000) -> torch.Tensor:
    """Random values over the whole range, every code value, every midpoint and the floats beside it."""
    gen = torch.Generator().manual_seed(0)
    v = _values(fmt).sort().values
    mid = ((v[1:].double() + v[:-1].double()) / 2).float()
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    rnd = torch.randn(n, generator=gen) * 10 ** torch.empty(n).uniform_(-5, 2.7, generator=gen)
    y = torch.cat([rnd, v, mid, torch.nextafter(mid, up), torch.nextafter(mid, down)])
    y = y.clamp(-fmt.max, fmt.max)
    return y if fmt.signed else y.abs()


def test_e4m3_is_torchs_float8_e4m3fn():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    ours = decode(codes, E4M3)
    assert torch.equal(ours.view(torch.int32), codes.view(torch.float8_e4m3fn).float().view(torch.int32))
    y = _probes(E4M3)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    got = encode(y, E4M3)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} codes differ, first at y={y[bad[0]].item()!r}"


def test_ue4m4_encodes_to_the_nearest_value_ties_to_even():
    values = _values(UE4M4)
    assert values.numel() == 256 and bool((values[1:] > values[:-1]).all())
    assert values[0] == 0 and values[1] == 2.0**-10 and values[-1] == UE4M4.max
    y = _probes(UE4M4, 20_000)
    code = encode(y, UE4M4).long()
    dist = (values.double()[None, :] - y.double()[:, None]).abs()
    best = dist.min(1).values
    assert bool((dist[torch.arange(y.numel()), code] == best).all()), "a code is not a nearest value"
    ties = (dist == best[:, None]).sum(1) > 1
    assert int(ties.sum()) >= 255 and bool((code[ties] % 2 == 0).all()), "a tie went to the odd code"


def test_keep_nonzero_and_saturation():
    y = torch.tensor([0.0, 1e-40, 2.0**-12, 2.0**-11, 600.0, 496.0])
    assert encode(y, UE4M4, keep_nonzero=True).tolist() == [0, 1, 1, 1, 255, 255]
    assert encode(y, UE4M4).tolist() == [0, 0, 0, 0, 255, 255]
    assert encode(torch.tensor([-1000.0, -0.0, 1000.0]), E4M3).tolist() == [0xFE, 0x80, 0x7E]


@pytest.mark.parametrize("fmt", [E4M3, UE4M4], ids=lambda f: f.name)
def test_kernel_codec_equals_torch_codec(kernel, fmt):
    unsigned = not fmt.signed
    codes = torch.arange(256, dtype=torch.uint8)
    x = torch.empty(256)
    kernel.decode_(codes, x, unsigned)
    keep = slice(None) if unsigned else (codes & 0x7F) != 0x7F
    assert torch.equal(x[keep].view(torch.int32), decode(codes, fmt)[keep].view(torch.int32))
    y = torch.cat([_probes(fmt), torch.tensor([0.0, 1e-40, 1e-30])])
    got = torch.empty(y.numel(), dtype=torch.uint8)
    kernel.encode_(y, got, unsigned)
    assert torch.equal(got, encode(y, fmt, keep_nonzero=unsigned))


def _fresh(init: torch.Tensor, lowp: bool) -> dict[str, torch.Tensor]:
    n = init.numel()
    out = {
        "master": init.clone(),
        STATE_KEYS[0]: torch.zeros(n, dtype=torch.uint8),
        STATE_KEYS[1]: torch.zeros(num_blocks(n)),
        STATE_KEYS[2]: torch.zeros(n, dtype=torch.uint8),
        STATE_KEYS[3]: torch.zeros(num_blocks(n)),
    }
    if lowp:
        out["lowp"] = torch.empty(n, dtype=torch.bfloat16)
    return out


def _run(kernel, init, grads, groups, *, lowp: bool, threads: int) -> tuple[dict, dict]:
    """The kernel's and the reference's tensors after the steps, from the same all-zero state."""
    n = init.numel()
    ours, ref = _fresh(init, lowp), _fresh(init, lowp)
    for t, g in enumerate(grads, start=1):
        lr = LR * (1 + 0.1 * t)  # a changing learning rate
        segments, s = _segments(groups, n, lr), _scalars(HYPER, lr, t)
        if kernel is not None:
            kernel.adamwfp8_step_(
                ours["master"], g, *(ours[k] for k in STATE_KEYS), ours.get("lowp"),
                [b for _, b, _ in segments], [1.0 if d is None else d for _, _, d in segments],
                *s.values(), threads,
            )  # fmt: skip
        reference_step(ref["master"], g, ref, segments, s, ref.get("lowp"))
    return ours, ref


def _assert_bitwise(ours: dict, ref: dict, what: str) -> None:
    for key, want in ref.items():
        got = ours[key]
        same = got.view(torch.uint8) == want.view(torch.uint8)
        if not bool(same.all()):
            first = int((~same).nonzero()[0]) // want.element_size()
            raise AssertionError(
                f"{what}: {key} differs at {first}: {got[first].item()!r} != {want[first].item()!r}"
            )


@pytest.mark.parametrize("n", [1, 255, 256, 257, 3 * BLOCK_SIZE + 77, 40_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_step_equals_reference_bitwise(kernel, one_torch_thread, n, dtype):
    init, grads = _inputs(n, 6, dtype)
    ours, ref = _run(kernel, init, grads, _groups(n), lowp=True, threads=0)
    _assert_bitwise(ours, ref, f"n={n} {dtype}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lowp", [False, True])
def test_threads_and_lowp_change_nothing(kernel, threads, lowp):
    """A unit of 300 blocks: with 2 threads torch's pool splits it in two tasks (128 blocks at least)."""
    n = 300 * BLOCK_SIZE + 5
    init, grads = _inputs(n, 3, torch.bfloat16, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, ref = _run(kernel, init, grads, _groups(n), lowp=lowp, threads=threads)
    finally:
        torch.set_num_threads(before)
    _assert_bitwise(ours, ref, f"threads={threads} lowp={lowp}")


def test_the_first_step_from_zero_state_is_adamw(kernel):
    """From an all-zero state the decoded moments are 0: step 1 is AdamW's first step up to rounding."""
    n = 1000
    init, grads = _inputs(n, 1, torch.float32)
    ours, _ = _run(kernel, init, grads, [], lowp=False, threads=1)
    g = grads[0].double()
    s = _scalars(HYPER, LR * 1.1, 1)
    want = init.double() + s.neg_step * (0.1 * g) / (torch.sqrt(0.05 * g * g) * s.inv_b2 + s.eps)
    torch.testing.assert_close(ours["master"].double(), want, rtol=1e-6, atol=1e-9)


def test_portable_loops_give_the_same_bits(kernel, tmp_path):
    """Under ATEN_CPU_CAPABILITY=default the kernel is built without vector ISA flags (the portable
    loops, no AVX-512 pass): its step still equals the reference computed here."""
    n, steps = 5 * BLOCK_SIZE + 3, 4
    init, grads = _inputs(n, steps, torch.bfloat16, seed=2)
    torch.save((init, grads), tmp_path / "inputs.pt")
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_fp8_codec as t; from slidekit_optim.kernel_build import load_kernel; "
        "k = load_kernel(t.SOURCE); print(torch.backends.cpu.get_cpu_capability(), k.vector_width()); "
        f"init, grads = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        f"ours, _ = t._run(k, init, grads, t._groups({n}), lowp=True, threads=1); "
        f"torch.save(ours, {str(tmp_path / 'result.pt')!r})"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    # The timeout only turns a hang into a failure: the child may build the kernel from cold.
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[:2] == ["DEFAULT", "1"], done.stdout
    _, ref = _run(None, init, grads, _groups(n), lowp=True, threads=1)
    _assert_bitwise(torch.load(tmp_path / "result.pt"), ref, "portable loops")


def test_the_rate_benchmark_runs_at_thread_counts_without_one(kernel):
    """benchmarks/fp8_codec.py rate at ``--threads 2`` (the H200 command passes 16 alone): every optimizer
    is built for the counts asked and the record has each one's rate and the ratios."""
    from bench_helpers import load_benchmark  # here: the portable-loops child imports this file alone

    out = load_benchmark("fp8_codec").rates(4 * BLOCK_SIZE + 5, 1, (2,))
    for name in ("layer_adam", "adamw_8bit", "adamw_fp8"):
        assert out[f"{name}_2t_gparams_s"]["median"] > 0
    for name, other in (
        ("adamw_fp8", "layer_adam"),
        ("adamw_fp8", "adamw_8bit"),
        ("adamw_8bit", "layer_adam"),
    ):
        # one round: the ratio is that round's rate of `name` over that of `other` (each rounded to 3 places)
        a, b = out[f"{name}_2t_gparams_s"]["median"], out[f"{other}_2t_gparams_s"]["median"]
        rounding = (a / b) * (5e-4 / a + 5e-4 / b) + 5e-4
        assert out[f"{name}_over_{other}_2t"]["median"] == pytest.approx(a / b, abs=rounding)
    assert out["adamw_8bit_decode"] in ("gather", "permute", "portable")


@pytest.mark.parametrize("n", [1, 15, 16, 1000, (1 << 17) + 37])
@pytest.mark.parametrize("copy", [0, 1, 2])
def test_rate_streams_move_every_byte(kernel, n, copy):
    """``rate --streams``' probes (benchmarks/csrc/update_streams.cpp) read and write every byte of their
    pass: each array's new value is the probe's arithmetic on every element (vector loop and tail, two
    tasks), the BF16 copy written in every copy mode and left alone without one."""
    from bench_helpers import load_benchmark

    module = load_benchmark("fp8_codec").load_streams()
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    gf, gbits = grad.float(), grad.view(torch.int16).to(torch.int32) & 0xFFFF
    torch.set_num_threads(max(2, torch.get_num_threads()))
    for fn, dtype in (("adam_streams", torch.float32), ("fp8_streams", torch.uint8)):
        master = torch.randn(n, generator=gen)
        if dtype == torch.float32:
            a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
            want_a, want_b = 0.5 * a + gf, 0.5 * b + gf
        else:
            a = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            b = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
            want_a = ((a.to(torch.int32) + (gbits & 0xFF)) & 0xFF).to(torch.uint8)
            want_b = ((b.to(torch.int32) ^ (gbits >> 8)) & 0xFF).to(torch.uint8)
        want_p = master + 1e-30 * gf
        lowp = torch.full((n,), 7.0, dtype=torch.bfloat16)
        getattr(module, fn)(master, grad, a, b, lowp, copy, 2)
        assert torch.equal(a, want_a) and torch.equal(b, want_b), fn
        assert torch.equal(master, want_p), fn
        want_copy = (want_p.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
        assert torch.equal(lowp, want_copy if copy else torch.full_like(lowp, 7.0)), (fn, copy)


def test_rate_streams_record(kernel):
    """``rate --streams`` times the probes in the same rounds and records each kernel's share of its roof."""
    from bench_helpers import load_benchmark

    out = load_benchmark("fp8_codec").rates(4 * BLOCK_SIZE + 5, 1, (1,), streams=True)
    for probe in ("adam_plain", "adam_nt", "fp8_plain", "fp8_nt", "fp8_nocopy"):
        assert out[f"streams_{probe}_1t_gparams_s"]["median"] > 0
    for key in ("layer_adam_of_roof", "adamw_fp8_of_roof", "adamw_8bit_of_roof", "roof_fp8_over_adam"):
        assert out[f"{key}_1t"]["median"] > 0


def test_rate_base_times_another_copy_of_the_kernels_in_the_same_rounds(kernel, csrc_copy):
    """``rate --base DIR``: the kernels built from another csrc copy are timed beside this tree's, with
    each kernel's per-round ratio to its base; this tree's own csrc is refused as a base."""
    from bench_helpers import load_benchmark

    fp8_codec = load_benchmark("fp8_codec")
    base = csrc_copy
    out = fp8_codec.rates(4 * BLOCK_SIZE + 5, 2, (1,), base=base)
    for name in ("layer_adam", "adamw_8bit", "adamw_fp8"):
        assert out[f"{name}_base_1t_gparams_s"]["median"] > 0
        assert out[f"{name}_over_base_1t"]["median"] > 0
    assert out["base"] == str(base)
    with pytest.raises(ValueError, match="own csrc"):
        fp8_codec.rates(4 * BLOCK_SIZE + 5, 1, (1,), base=CSRC)


def test_build_makes_what_rate_loads_side_by_side_and_names_a_failure(kernel, csrc_copy):
    """``build --streams --base DIR``: every source ``rate`` would load is built (here found in the
    build cache: the base is a copy), one process each; a base whose source does not compile is
    reported not ok with the compiler's last lines, the others still ok."""
    from bench_helpers import load_benchmark

    fp8_codec = load_benchmark("fp8_codec")
    base = csrc_copy
    record = fp8_codec.build(base, streams=True)
    assert record["ok"], record
    assert set(record["built"]) == {
        *fp8_codec.KERNEL_FILES,
        *(f"{name}_base" for name in fp8_codec.KERNEL_FILES),
        "streams",
    }
    broken = base / fp8_codec.KERNEL_FILES["adamw_8bit"]
    broken.write_text(broken.read_text() + "\nthis is not C++;\n")
    record = fp8_codec.build(base)
    assert not record["ok"]
    failed = record["built"]["adamw_8bit_base"]
    assert not failed["ok"] and "adamw8.cpp" in failed["log"], failed
    assert all(e["ok"] for name, e in record["built"].items() if name != "adamw_8bit_base"), record


def test_a_base_without_the_kernels_sources_is_refused_naming_them(tmp_path):
    """``--base`` must be another copy of the csrc: a directory without the three sources is refused
    before anything is built or timed, naming the missing files and how to make a copy."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_codec.py"
    (tmp_path / "fused_adam.cpp").write_text("")
    done = subprocess.run(
        [sys.executable, str(script), "build", "--base", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "adamw8.cpp, adamwfp8.cpp" in done.stderr and "git archive" in done.stderr, done.stderr


def test_builds_past_the_timeout_are_killed_with_their_compilers_and_reported(
    tmp_path, csrc_copy, monkeypatch
):
    """``build --timeout``: a build still running when the time is up is killed with its whole process
    group (the compiler it started would otherwise go on loading the host under the timed rounds) and
    reported not ok, saying so. Each build here is a child that starts a "compiler" and waits for it."""
    from bench_helpers import load_benchmark

    fp8_codec = load_benchmark("fp8_codec")
    marker = f"slidekit-fake-compiler-{tmp_path.name}"
    monkeypatch.setattr(
        fp8_codec,
        "_BUILD_CHILD",
        "import subprocess, sys; "
        f"subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])",
    )
    record = fp8_codec.build(csrc_copy, timeout=3.0)
    assert not record["ok"] and len(record["built"]) == 6
    for name, entry in record["built"].items():
        assert not entry["ok"] and "killed after 3 s" in entry["log"], (name, entry)
    deadline = time.monotonic() + 10
    while True:
        left = subprocess.run(
            ["pgrep", "-f", marker], capture_output=True, text=True, check=False
        ).stdout.split()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"the builds' compilers outlived the kill: {left}"
