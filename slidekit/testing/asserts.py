"""Comparisons that say where and by how much two results differ."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["assert_losses_close", "assert_states_close", "assert_states_equal", "rel_error", "trained_state"]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (||a - b|| when b is zero)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff / denom if denom else diff


def assert_states_close(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], *, rtol: float
) -> None:
    """Every tensor of ``expected`` is in ``actual`` with relative error <= ``rtol``; lists the worst."""
    missing = sorted(set(expected) - set(actual))
    assert not missing, f"missing parameters: {missing}"
    errors = sorted(((rel_error(actual[n], expected[n]), n) for n in expected), reverse=True)
    bad = [(e, n) for e, n in errors if not e <= rtol]
    if bad:
        lines = []
        for e, n in bad[:8]:
            d = (actual[n].double().cpu() - expected[n].double().cpu()).abs()
            where = tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape))
            lines.append(f"  {n}: rel {e:.3e}, worst element {where} off by {d.max().item():.3e}")
        raise AssertionError(
            f"{len(bad)} of {len(errors)} tensors differ by more than {rtol:g}:\n" + "\n".join(lines)
        )


def assert_states_equal(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Bitwise equality of two states; names the tensors that differ."""
    assert set(actual) == set(expected), f"different names: {sorted(set(actual) ^ set(expected))}"
    differ = [n for n in expected if not torch.equal(actual[n], expected[n])]
    assert not differ, f"{len(differ)} tensors are not bitwise equal, e.g. {differ[:5]}"


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], *, rtol: float) -> None:
    """Same number of steps, each loss within ``rtol`` relative; shows the worst step."""
    assert len(actual) == len(expected), f"{len(actual)} losses, expected {len(expected)}"
    errs = [abs(a - b) / abs(b) for a, b in zip(actual, expected, strict=True)]
    worst = max(range(len(errs)), key=errs.__getitem__)
    assert errs[worst] <= rtol, (
        f"step {worst + 1}: loss {actual[worst]:.8f} vs {expected[worst]:.8f} (rel {errs[worst]:.3e} > {rtol:g})"
    )


def trained_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Every FP32 master (``master/<name>``) and every optimizer state buffer (``state/<unit>/<name>``) of
    a ``slidekit.Trainer``, copied once every update has been applied: what two runs that must agree bit
    for bit are compared on."""
    out = {f"master/{k}": v.clone() for k, v in trainer.state_dict().items()}
    store = trainer.engine.host.state
    for u in range(len(trainer.spec.units)):
        for name in store.layout(u):
            out[f"state/{u}/{name}"] = store.read_buffer(u, name)
    return out
