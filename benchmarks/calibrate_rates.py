"""The step-time model against the measured steps: the H200 profile's compute figures, and the table.

    python benchmarks/calibrate_rates.py              # the derived figures, then predicted vs measured
    python benchmarks/calibrate_rates.py --markdown   # the calibration table of docs/planning.md

Reads the committed ``slidekit bench`` suite records (``RECORDS``), rebuilds each slidekit cell's
``Layout`` from its model preset, batch, sequence length, residency mode, window and optimizer (on
the H200 profile's device memory, so "auto" gets the residency it got there), predicts its step
with ``slidekit.planning.profiles.H200_RATES`` and compares it with the measured one: tokens per
step over tokens/s, i.e. the mean of the timed steps, the last of which ends once every update is
applied (``StepPrediction.mean_over``). ``derive`` recomputes the figures the profile states as
measured from the same records' lanes: the decoder layers' and the head's achieved TFLOPS and the
device memory bandwidth from the all-resident cells, and the per-step host overhead. CPU only, no
device. ``tests/test_timing_calibration.py`` runs ``cells`` and ``derive`` and holds every cell
within 15%.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "benchmarks" / "raw"
#: The suites the H200 profile is calibrated on (the all-resident cells) and checked against (all).
RECORDS = (
    RAW / "2026-12-01-s6" / "suite-qwen2.5-3b.jsonl",
    RAW / "2026-12-01-s7" / "suite-qwen2.5-7b.jsonl",
    RAW / "2026-12-01-s7" / "suite-qwen2.5-14b.jsonl",
)
#: Only these suites' all-resident cells set the compute figures; the 14B suite has none.
CALIBRATION = RECORDS[:2]


@dataclass(frozen=True)
class Cell:
    """One measured slidekit run, its rebuilt layout and its prediction."""

    source: str  # the record file, relative to docs/benchmarks
    record: dict[str, Any]
    layout: Any  # slidekit.planning.Layout
    prediction: Any  # slidekit.planning.StepPrediction

    @property
    def measured_s(self) -> float:
        r = self.record
        return r["batch"] * r["seq"] / r["tokens_per_s"]

    @property
    def predicted_s(self) -> float:
        return float(self.prediction.mean_over(self.record["steps"]))

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def resident(self) -> str:
        return f"{sum(self.layout.resident)}/{len(self.layout.units)}"

    @property
    def label(self) -> str:
        r = self.record
        clip = "" if r["max_grad_norm"] is None else f", clip {r['max_grad_norm']:g}"
        return f"{r['model']} b{r['batch']} resident {r['resident']}{clip}, repeat {r['repeat']}"


def runs(paths: tuple[Path, ...] = RECORDS) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every slidekit run record that finished ("ok") in ``paths``."""
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if r.get("record") == "run" and r.get("system") == "slidekit" and r.get("status") == "ok":
                yield str(path.relative_to(RAW.parent)), r


@functools.cache
def _plugins() -> Any:
    from slidekit.plugins import Plugins

    return Plugins()


@functools.cache
def _spec(model: str, seq: int) -> Any:
    from slidekit.tools.presets import arch_spec

    return arch_spec(model, seq)


@functools.cache
def _state_layout(name: str) -> Any:
    """The optimizer's state layout (built with ``impl="torch"``: the layout alone, no kernel build)."""
    from slidekit.interfaces import OptimizerHyper

    return _plugins().get("optimizer", name).descriptor.factory(OptimizerHyper(), impl="torch").state_layout


def _planner(record: dict[str, Any]) -> Any:
    from slidekit.planning import Planner, Workload

    plugins = _plugins()
    clip = record["max_grad_norm"] is not None
    return Planner(
        _spec(record["model"], record["seq"]),
        Workload(batch_size=record["batch"], seq_len=record["seq"], keep_grads=clip),
        compute_itemsize=2,  # BF16 on the H200
        state_layout=_state_layout(record["optimizer"]),
        media={r.name: r.descriptor.medium for r in plugins.drivers("tier")},
        device_type="cuda",
        window=record["window"],
        device_tier="gpu",
        host_tier="ram",
        disk_tier="posix",
        optimizer=record["optimizer"],
        clip=clip,
        # Every committed cell was measured with every layer recomputing (before engine.recompute existed).
        recompute=record.get("recompute", "all"),
    )


def h200_machine(record: dict[str, Any]) -> Any:
    """The H200 machine as the run found it: the profile's device memory, the RAM free at its start."""
    from slidekit.planning import GIB, Machine
    from slidekit.planning.profiles import PROFILES

    h200 = PROFILES["h200"]
    ram = int(record.get("mem_available_at_start_gib", 125.0) * GIB)
    return Machine(
        device_type="cuda",
        device_free=h200.device_free,
        device_total=h200.device_total,
        host_available=ram,
        host_total=ram,
        rates=h200.rates,
        gpu=h200.name,
    )


def cells(paths: tuple[Path, ...] = RECORDS) -> list[Cell]:
    """Every measured cell of ``paths``, rebuilt and predicted."""
    from slidekit.planning import Placement

    out = []
    for source, r in runs(paths):
        planner, machine = _planner(r), h200_machine(r)
        placement = Placement(
            gpu_resident=r["resident"],
            state_tier=r["state_tier"],
            activation_tier=r.get("activations", "device"),  # records before the "auto" defaults: as they ran
            resident_weights=r.get("resident_weights", "keep"),
        )
        layout = planner.layout(placement, machine)
        prediction = planner.predict(layout, machine)
        out.append(Cell(source, r, layout, prediction))
    return out


def derive(paths: tuple[Path, ...] = CALIBRATION) -> dict[str, float]:
    """The figures the H200 profile states as measured, from the all-resident cells' lanes."""
    from slidekit.planning.rates import GRAD_PASS_BYTES
    from slidekit.planning.timing import StepWork

    layer_flops = layer_s = head_flops = head_s = moved = update_s = 0.0
    resident = [r for _, r in runs(paths) if r["resident"] == "all" and r["max_grad_norm"] is None]
    for r in resident:
        spec = _spec(r["model"], r["seq"])
        work = StepWork.of(spec, _planner(r).workload, optimizer="", state_bytes_per_param=0, clip=False)
        lanes = r["lanes_s"]
        layer_flops += 4 * sum(work.layer_flops(u.numel) for u in spec.units if u.kind == "layer")
        layer_s += lanes["fwd"] + lanes["bwd"]
        head_flops += 6.0 * work.head_params * work.tokens
        head_s += lanes["head"]
        moved += 28.0 * spec.num_params  # layer_adam's fused device pass
        update_s += lanes["update_gpu"]
    device_gbps = moved / update_s / 1e9
    overhead = []
    for r in resident:
        spec = _spec(r["model"], r["seq"])
        lanes = r["lanes_s"]
        passes = GRAD_PASS_BYTES * spec.num_params / (device_gbps * 1e9)
        step = r["batch"] * r["seq"] / r["tokens_per_s"]
        overhead.append(step - (lanes["fwd"] + lanes["bwd"] + lanes["head"] + lanes["update_gpu"]) - passes)
    return {
        "layer_tflops": layer_flops / layer_s / 1e12,
        "head_tflops": head_flops / head_s / 1e12,
        "device_gbps": device_gbps,
        "step_overhead_s": mean(overhead),
    }


def markdown(found: list[Cell]) -> str:
    from slidekit.planning.timing import LABELS

    rows = [
        "| cell | record | resident units | bound by | predicted s | measured s | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in found:
        rows.append(
            f"| {c.label} | {c.source} | {c.resident} | {LABELS[c.prediction.bound]} | {c.predicted_s:.3f} | "
            f"{c.measured_s:.3f} | {c.error:+.1%} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the calibration table as markdown")
    args = parser.parse_args()
    found = cells()
    if args.markdown:
        print(markdown(found))
        return
    print(json.dumps({k: round(v, 4) for k, v in derive().items()}))
    for c in found:
        print(
            f"{c.label:48} {c.resident:>6}  predicted {c.predicted_s:7.3f} s  measured {c.measured_s:7.3f} s  "
            f"{c.error:+6.1%}  bound by {c.prediction.bound}"
        )
    worst = max(found, key=lambda c: abs(c.error))
    print(f"worst: {worst.label} {worst.error:+.1%}")


if __name__ == "__main__":
    main()
