"""The kernel build lock: a build killed halfway is taken over, a live build is waited for, within a bound.

The lock tests run real child processes that hold the lock (and torch's
``lock`` file, as a torch build does), kill them with SIGKILL or let them
finish, and compile nothing. ``test_a_build_killed_while_compiling_is_taken_over``
kills (SIGKILL) the Python process of a real ``torch.utils.cpp_extension``
build of layer_adam's kernel while it compiles, as ``kill -9 PID`` does, and
builds it again (one compile, ~30-60 s on 2 cores, in a private extensions
directory so the shared cache is never left with a stale lock); without the
takeover the second build waits forever (torch's ``FileBaton``).
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim import kernel_build
from slidekit_optim.build_lock import (
    DEFAULT_TIMEOUT_S,
    ENV_TIMEOUT,
    TORCH_LOCK,
    BuildLockTimeout,
    build_timeout,
    exclusive_build,
    lock_path,
)
from slidekit_optim.kernel_build import KernelUnavailable, kernel_status
from slidekit_optim.layer_adam import KERNEL_SOURCE, LayerAdam

HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8)

#: Plays a build of directory argv[1], in one of three ways (argv[2]):
#: "slidekit": holds slidekit's build lock and torch's lock file inside, as a slidekit build does;
#: "compiler": the same, plus a child process working in the directory (as ninja does), its pid printed;
#: "torch": holds torch's lock file open without slidekit's lock, as a torch build elsewhere does.
#: It prints "held", then holds until its stdin closes (then it cleans up like a finished build) or
#: it is killed (then torch's lock file stays behind).
HOLDER = """
import os, subprocess, sys
from pathlib import Path
from slidekit_optim.build_lock import TORCH_LOCK, exclusive_build

directory, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "torch":
    directory.mkdir(parents=True)
    fd = os.open(directory / TORCH_LOCK, os.O_CREAT | os.O_EXCL)  # what torch's FileBaton does
    print("held", flush=True)
    sys.stdin.read()
    os.close(fd)
    (directory / TORCH_LOCK).unlink()
    sys.exit()
with exclusive_build(directory, what="the test kernel", timeout=0):
    (directory / TORCH_LOCK).touch()
    if mode == "compiler":
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], cwd=directory)
        print(worker.pid, flush=True)
    print("held", flush=True)
    sys.stdin.read()
    (directory / TORCH_LOCK).unlink()
"""


def _read_line(proc: subprocess.Popen[bytes], timeout: float = 120.0) -> str:
    """The child's next stdout line; fails (with its stderr) if it exits or stays silent for ``timeout`` s.

    The pipe is unbuffered, so a line read never takes the next one along out of the selector's sight.
    """
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            pytest.fail(f"the child printed nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        pytest.fail(f"the child exited ({proc.wait()}) without printing: {proc.stderr.read().decode()}")
    return line.decode().strip()


@contextmanager
def _holding(directory: Path, mode: str = "slidekit") -> Iterator[subprocess.Popen[bytes]]:
    """A child process playing a build of ``directory`` (see HOLDER); killed on the way out if still alive."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        if mode != "compiler":
            assert _read_line(proc) == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _release(proc: subprocess.Popen[bytes]) -> None:
    """Let a HOLDER finish its build."""
    assert proc.stdin is not None
    proc.stdin.close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A child holding the build lock of ``tmp_path / "build"``, and that directory."""
    directory = tmp_path / "build"
    with _holding(directory) as proc:
        yield proc, directory


def test_the_holder_records_its_pid_beside_the_build_directory(holder):
    proc, directory = holder
    assert lock_path(directory) == directory.parent / "build.lock"
    assert lock_path(directory).read_text().split()[0] == str(proc.pid)
    assert (directory / TORCH_LOCK).exists()


def test_a_stale_lock_left_by_a_killed_builder_is_taken_over(holder):
    proc, directory = holder
    proc.send_signal(signal.SIGKILL)  # no cleanup runs: torch's lock file stays, as after kill -9
    proc.wait()
    assert (directory / TORCH_LOCK).exists()

    said: list[str] = []
    with exclusive_build(directory, what="the test kernel", timeout=5, say=said.append) as held:
        assert held.stale == directory / TORCH_LOCK
        assert not (directory / TORCH_LOCK).exists()
        assert lock_path(directory).read_text().split()[0] == str(os.getpid())
    assert (
        len(said) == 1
        and "removed the stale build lock" in said[0]
        and str(directory / TORCH_LOCK) in said[0]
    )


def test_a_live_builder_makes_the_next_wait_then_give_up_clearly(holder):
    proc, directory = holder
    said: list[str] = []
    start = time.monotonic()
    with (
        pytest.raises(BuildLockTimeout) as caught,
        exclusive_build(directory, what="the test kernel", timeout=0.5, say=said.append),
    ):
        pytest.fail("the lock was taken while its holder lives")
    waited = time.monotonic() - start
    assert waited >= 0.5
    message = str(caught.value)
    for part in (
        str(lock_path(directory)),
        f"pid {proc.pid}",
        "the test kernel",
        ENV_TIMEOUT,
        "slidekit build",
    ):
        assert part in message, (part, message)
    assert len(said) == 1 and said[0].startswith(f"waiting for pid {proc.pid}"), said
    assert str(lock_path(directory)) in said[0] and "giving up after 0.5 s" in said[0]
    assert (directory / TORCH_LOCK).exists()  # a live holder's torch lock is never touched
    assert proc.poll() is None


def test_the_wait_ends_when_the_holder_finishes(holder):
    proc, directory = holder
    said: list[str] = []

    def release_on_announce(message: str) -> None:  # the holder finishes only once we wait
        said.append(message)
        _release(proc)

    with exclusive_build(directory, what="the test kernel", timeout=120, say=release_on_announce) as held:
        assert held.waited_s > 0 and held.stale is None
    assert proc.wait() == 0
    assert len(said) == 1 and said[0].startswith("waiting for")


needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc")


@needs_proc
def test_the_compiler_of_a_killed_build_is_waited_for(tmp_path):
    directory = tmp_path / "build"
    with _holding(directory, "compiler") as proc:
        worker = int(_read_line(proc))
        try:
            assert _read_line(proc) == "held"
            proc.send_signal(signal.SIGKILL)  # the Python process alone: its compiler works on
            proc.wait()
            said: list[str] = []

            def stop_worker_on_announce(message: str) -> None:
                said.append(message)
                os.kill(worker, signal.SIGKILL)

            with exclusive_build(
                directory, what="the kernel", timeout=120, say=stop_worker_on_announce
            ) as held:
                assert held.stale == directory / TORCH_LOCK
        finally:
            with suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
    assert (
        said[0].startswith(f"waiting for pid {worker} (python") and "runs in the build directory" in said[0]
    )
    assert "removed the stale build lock" in said[1]


@needs_proc
def test_a_torch_build_without_slidekit_lock_is_waited_for_and_never_broken(tmp_path):
    directory = tmp_path / "build"
    with _holding(directory, "torch") as proc:
        said: list[str] = []
        with (
            pytest.raises(BuildLockTimeout) as caught,
            exclusive_build(directory, what="the test kernel", timeout=0.5, say=said.append),
        ):
            pytest.fail("the lock was taken while a torch build holds it")
        assert f"pid {proc.pid} (python" in str(caught.value) and "open without slidekit's lock" in str(
            caught.value
        )
        assert str(directory / TORCH_LOCK) in str(caught.value) and ENV_TIMEOUT in str(caught.value)
        assert len(said) == 1 and said[0].startswith(f"waiting for pid {proc.pid}")
        assert (directory / TORCH_LOCK).exists()  # a live build's lock is never removed

        said.clear()

        def release_on_announce(message: str) -> None:
            said.append(message)
            _release(proc)

        with exclusive_build(directory, what="the test kernel", timeout=120, say=release_on_announce) as held:
            assert held.stale is None  # the torch build removed its lock itself
        assert proc.wait() == 0 and len(said) == 1


def test_the_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)
    assert build_timeout() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv(ENV_TIMEOUT, " 12.5 ")
    assert build_timeout() == 12.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match=rf"{ENV_TIMEOUT}='{bad}' is not valid.*>= 0"):
            build_timeout()


# --------------------------------------------------------------------------- with torch's builds


@pytest.fixture
def compiler() -> None:
    """Skip where nothing can be compiled: there the build never reaches the lock."""
    status = kernel_status()
    if status.startswith("pure torch (no C++ compiler") or status.startswith("pure torch (ninja"):
        pytest.skip(status)


def _source_copy(tmp_path: Path) -> Path:
    """layer_adam's kernel source (and the headers it includes) at a path no test has loaded yet."""
    target = tmp_path / "src"
    target.mkdir()
    for f in [KERNEL_SOURCE, *KERNEL_SOURCE.parent.glob("*.h")]:
        shutil.copy(f, target / f.name)
    return target / KERNEL_SOURCE.name


def test_a_live_builder_makes_the_optimizer_wait_then_fall_back(
    compiler, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(ENV_TIMEOUT, "0.5")
    source = _source_copy(tmp_path)
    directory = kernel_build._build_spec(source).directory
    with _holding(directory) as proc:
        with caplog.at_level(logging.WARNING, logger="slidekit_optim.layer_adam"):
            assert LayerAdam(HYPER, kernel_source=source).impl == "torch"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "gave up after" in warnings[0] and str(lock_path(directory)) in warnings[0]
        assert f"waiting for pid {proc.pid}" in capsys.readouterr().err
        with pytest.raises(KernelUnavailable, match=r"impl='cpp'.*build lock"):
            LayerAdam(HYPER, impl="cpp", kernel_source=source)


def test_the_ninja_probe_and_the_source_hash_are_taken_once_per_process(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    probes: list[bool] = []
    real = cpp_extension.is_ninja_available
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: probes.append(real()) or probes[-1])
    kernel_build._ninja_available.cache_clear()
    source = _source_copy(tmp_path)
    try:
        for _ in range(3):
            kernel_status(source)
    finally:
        kernel_build._ninja_available.cache_clear()  # the next probe is the real one again
    compiler_here = shutil.which(os.environ.get("CXX", "c++")) is not None  # else no probe is needed
    assert len(probes) == (1 if compiler_here else 0)

    name = kernel_build._build_spec(source).name
    st = source.stat()
    text = source.read_bytes()
    source.write_bytes(text.replace(b"#include", b"#INCLUDE", 1))  # same size and mtime: not read again
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert kernel_build._build_spec(source).name == name
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # an edit: read and hashed anew
    assert kernel_build._build_spec(source).name != name


def test_a_source_elsewhere_names_its_include_dirs_and_their_headers_key_the_build(tmp_path):
    """A probe outside csrc/ that includes the kernels' headers (benchmarks/csrc/update_streams.cpp)
    passes ``include_dirs``: the build is named after its stem, and an edit to a header there rebuilds."""
    probe_dir, headers = tmp_path / "probe", tmp_path / "headers"
    probe_dir.mkdir()
    headers.mkdir()
    source = probe_dir / "my_probe.cpp"
    source.write_text('#include "shared.h"\n')
    header = headers / "shared.h"
    header.write_text("// one\n")
    spec = kernel_build._build_spec(source, include_dirs=(headers,))
    assert spec.name.startswith("slidekit_my_probe_") and spec.include_dirs == (headers,)
    assert kernel_build._build_spec(source).name != spec.name  # without the directory: another build
    st = header.stat()
    header.write_text("// two\n")
    os.utime(header, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert kernel_build._build_spec(source, include_dirs=(headers,)).name != spec.name


_PROBE = """#include <torch/extension.h>
#include "shared.h"
static int64_t value() { return SHARED_VALUE; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("value", &value); }
"""


@pytest.mark.slow
def test_one_source_with_other_include_dirs_is_another_kernel_in_the_process(compiler, tmp_path, monkeypatch):
    """A process that loads one source with two header directories gets two kernels, each with its own
    headers, and each is then found again (not the first build under the second's headers)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "probe" / "header_probe.cpp"
    source.parent.mkdir()
    source.write_text(_PROBE)
    dirs = []
    for value in (3, 5):
        d = tmp_path / f"headers{value}"
        d.mkdir()
        (d / "shared.h").write_text(f"#define SHARED_VALUE {value}\n")
        dirs.append(d)
    first = kernel_build.load_kernel(source, include_dirs=(dirs[0],))
    second = kernel_build.load_kernel(source, include_dirs=(str(dirs[1]),))
    assert (first.value(), second.value()) == (3, 5)
    assert kernel_build.load_kernel(source, include_dirs=(dirs[0],)) is first
    assert kernel_build.load_kernel(str(source), include_dirs=(dirs[1],)) is second


def _wait_for_output(capsys, text: str, bound: float = 120.0) -> str:
    """What was written to stderr until ``text`` appeared in it; fails after ``bound`` seconds without it."""
    seen, deadline = "", time.monotonic() + bound
    while text not in seen:
        assert time.monotonic() < deadline, f"{text!r} never appeared on stderr: {seen!r}"
        time.sleep(0.05)
        seen += capsys.readouterr().err
    return seen


def test_a_thread_waiting_for_a_build_holds_up_no_other_thread(compiler, tmp_path, monkeypatch, capsys):
    """While one thread waits (within its bound) for another process's build, a status check answers
    at once and another thread gives up on its own, shorter bound: no process-wide lock is held."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = _source_copy(tmp_path)
    directory = kernel_build._build_spec(source).directory
    outcome: list[BaseException | None] = []

    def patient() -> None:
        try:
            kernel_build.load_kernel(source, timeout=DEFAULT_TIMEOUT_S)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with _holding(directory) as proc:
        waiter = threading.Thread(target=patient, name="patient-build", daemon=True)
        waiter.start()
        _wait_for_output(capsys, f"waiting for pid {proc.pid}")
        assert kernel_status(source) == "fused C++ kernel (built on first use)"
        with pytest.raises(KernelUnavailable, match=r"gave up after .* held by pid"):
            kernel_build.load_kernel(source, timeout=0.2)
        assert waiter.is_alive()  # still waiting, within its own bound
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # its build, once it may, fails fast
        _release(proc)
        waiter.join(300)
    assert not waiter.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], KernelUnavailable), outcome


_BUILD = (
    "import sys; from slidekit_optim.kernel_build import load_kernel; load_kernel(sys.argv[1]); print('ok')"
)


@pytest.mark.slow
def test_a_build_killed_while_compiling_is_taken_over(compiler, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # inherited by the children
    source = _source_copy(tmp_path)
    directory = kernel_build._build_spec(source).directory
    log = tmp_path / "first.log"
    with log.open("w") as err:
        first = subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(source)], stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        deadline = time.monotonic() + 300
        # torch writes build.ninja under its lock right before it runs the compiler
        while not ((directory / TORCH_LOCK).exists() and (directory / "build.ninja").exists()):
            assert first.poll() is None, f"the first build ended before compiling: {log.read_text()}"
            assert time.monotonic() < deadline, f"the first build never started compiling: {log.read_text()}"
            time.sleep(0.05)
    finally:  # kill -9 of the Python process alone: ninja and the compiler (in process groups of
        first.kill()  # their own) finish the file; the next build waits for them where /proc tells
        first.wait()
    assert (directory / TORCH_LOCK).exists()  # stale: left by the killed build

    again = subprocess.run(
        [sys.executable, "-c", _BUILD, str(source)], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0 and again.stdout.strip() == "ok", again.stderr
    assert "removed the stale build lock" in again.stderr and str(directory / TORCH_LOCK) in again.stderr
    assert not (directory / TORCH_LOCK).exists()

    # The kernel built after the takeover loads (cached now) and computes what the torch path does.
    opt = LayerAdam(HYPER, impl="cpp", kernel_source=source)
    n = 4099
    master, grad = torch.randn(n), torch.randn(n)
    groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    results = []
    for o in (opt, LayerAdam(HYPER, impl="torch")):
        p, state = master.clone(), {k: torch.zeros(c) for k, (_, c) in o.state_layout(n).items()}
        o.step(p, grad, state, lr=1e-3, count=1, groups=groups)
        results.append(p)
    assert torch.equal(results[0], results[1])
