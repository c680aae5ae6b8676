"""Developer sessions: ``nox -s tests``, ``lint``, ``types``, ``gpu``, ``bench``.

``tests`` is what CI runs (.ci/run calls the README's test command, which is
the same pytest call). ``gpu`` is the GPU gate (benchmarks/gpu_gate.py: the
whole suite and short real-shape runs on a CUDA machine, recorded in
docs/benchmarks/GPU-VERIFIED.json); ``bench`` the throughput benchmark.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "types"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]", "-c", "constraints.txt")
    session.run("pytest", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff", "-c", "constraints.txt")
    session.run(
        "ruff", "check", "slidekit", "plugins", "tests", "benchmarks", "docs", "scripts", "noxfile.py"
    )


@nox.session
def types(session: nox.Session) -> None:
    session.install("-e", ".[dev]", "-c", "constraints.txt")
    session.run("mypy", "slidekit")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU gate, on the GPU machine in its own environment: the whole test suite plus one short
    real-shape run per residency mode; writes docs/benchmarks/GPU-VERIFIED.json (benchmarks/gpu_gate.py).
    ``nox -s gpu -- --check`` says whether the record covers the checked-out commit."""
    session.run("python", "benchmarks/gpu_gate.py", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    session.run("python", "benchmarks/train_throughput.py", *session.posargs)
