"""The fused CPU kernels refuse bad arguments with a RuntimeError naming the argument, and do not crash.

Each call runs in a child process: on the H200 machine's image (torch 2.11) a failing argument check
of ``csrc/adamwfp8.cpp`` once killed the pytest worker with SIGSEGV instead of raising (the GPU gate
of 2026-12-02), which took the rest of that worker's tests down with it. A child that dies reports
its signal here. The checks throw ``std::runtime_error`` (``SLIDEKIT_CHECK`` in ``csrc/adam_common.h``);
on the next gate (0df7faf) the three cases whose message streamed an integer still crashed there, so
the messages are now built without an iostream. The cases cover every kind of piece a message has:
text, integers, dtypes and devices.

Test: ``pytest tests/plugins/test_kernel_errors.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from slidekit_optim.kernel_build import CSRC, kernel_status, load_kernel

#: kernel source -> (the child's call with one bad argument, the message it must raise).
CASES = {
    "fused_adam: a short exp_avg": (
        "fused_adam.cpp",
        "k.fused_adamw_(z(n), z(n), z(n - 1), z(n), None, False, 1.0, 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0)",
        "exp_avg has 299 elements, expected 300",
    ),
    "fused_adam: exp_avg off the CPU": (
        "fused_adam.cpp",
        "k.fused_adamw_(z(n), z(n), torch.zeros(n, device='meta'), z(n), None, False, 1.0, 0.1, 0.95, 0.05, 1.0,"
        " 1e-8, -1e-3, 0)",
        "exp_avg must be on the CPU, got meta",
    ),
    "fused_adam: a backup without its moments": (
        "fused_adam.cpp",
        "k.fused_adamw_(z(n), z(n), z(n), z(n), None, False, 1.0, 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0, z(n))",
        "give backup_master, backup_exp_avg and backup_exp_avg_sq together",
    ),
    "fused_adam: out of place without the buffers": (
        "fused_adam.cpp",
        "k.fused_adamw_(z(n), z(n), z(n), z(n), None, False, 1.0, 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0,"
        " out_of_place=True)",
        "out_of_place writes the update into backup_master, backup_exp_avg and backup_exp_avg_sq",
    ),
    "adamw8: out of place without the buffers": (
        "adamw8.cpp",
        "k.adamw8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, z(256), i(8), z(256), i(8),"
        " [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0, out_of_place=True)",
        "out_of_place writes the update into the five backup buffers",
    ),
    "adamw8: a master of the wrong dtype": (
        "adamw8.cpp",
        "k.adamw8_step_(z(n, torch.float64), z(n), u(n), z(2), u(n), z(2), None, z(256), i(8), z(256), i(8),"
        " [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0)",
        "master must be Float, got Double",
    ),
    "adamwfp8: a short absmax": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(1), u(n), z(2), None, [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0)",
        "exp_avg_absmax has 1 elements, expected 2",
    ),
    "adamwfp8: out of place without the buffers": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0,"
        " out_of_place=True)",
        "out_of_place writes the update into the five backup buffers",
    ),
    "adamwfp8: the buffers without out_of_place": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0,"
        " z(n), u(n), z(2), u(n), z(2))",
        "the five backup buffers receive the update out of place; pass out_of_place=True",
    ),
    "adamwfp8: four of the five buffers": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0,"
        " z(n), u(n), z(2), u(n), out_of_place=True)",
        "give all five backup buffers (master, both moments' codes and absmax) or none",
    ),
    "adamwfp8: a short output absmax": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, [n], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8, -1e-3, 0,"
        " z(n), u(n), z(2), u(n), z(1), True)",
        "backup_exp_avg_sq_sqrt_absmax has 1 elements, expected 2",
    ),
    "adamwfp8: segments that do not tile the unit": (
        "adamwfp8.cpp",
        "k.adamwfp8_step_(z(n), z(n), u(n), z(2), u(n), z(2), None, [n - 1], [1.0], 0.1, 0.95, 0.05, 1.0, 1e-8,"
        " -1e-3, 0)",
        "the decay segments must tile [0, 300) in order",
    ),
}

CHILD = textwrap.dedent(
    """
    import sys, torch
    from slidekit_optim.kernel_build import CSRC, load_kernel
    k = load_kernel(CSRC / sys.argv[1])
    n = 300
    z = lambda m, dt=torch.float32: torch.zeros(m, dtype=dt)
    u = lambda m: torch.zeros(m, dtype=torch.uint8)
    i = lambda m: torch.zeros(m, dtype=torch.int32)
    try:
        exec(sys.argv[2])
    except RuntimeError as e:
        print("RAISED", e)
        sys.exit(0)
    print("NO ERROR")
    sys.exit(3)
    """
)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_bad_argument_raises_a_runtime_error_naming_it(case):
    source, call, message = CASES[case]
    status = kernel_status(CSRC / source)
    if status.startswith(("pure torch (no C++ compiler", "pure torch (ninja")):
        pytest.skip(f"{source}: {status}")
    load_kernel(CSRC / source)  # built here first, so the child loads it from the cache
    # The timeout only turns a hang into a failure.
    done = subprocess.run(
        [sys.executable, "-c", CHILD, source, call],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ,
    )
    if done.returncode < 0:
        pytest.fail(
            f"{case}: the child died with signal {-done.returncode} instead of raising\n{done.stderr[-3000:]}"
        )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "RAISED" in done.stdout and message in done.stdout, done.stdout
