"""A suite's table: its rows gathered into cells (one per run label, recipe and batch), with repeats.

A cell's figure is the median over its repeats (separate processes) of tokens/s, with [min-max];
``n`` says how many repeats ran. Columns computed per cell:

- offload efficiency (slidekit rows): tokens/s / slidekit all-resident's at the same batch and recipe
  (same kernels, same machine, same call: the paper's "fraction of non-offload peak");
- vs best no-offload (slidekit rows): tokens/s / the fastest of HF + Liger (GC), HF + Liger (no GC)
  and plain HF (GC) that ran at the same batch and recipe, which one named;
- vs torchao / DeepSpeed / DeepSpeed partial (slidekit rows): tokens/s / theirs.

Every ratio compares cells on the same number of GPUs. A suite with runs on several GPUs gets the
data-parallel table too (``dp_table``): per cell its GPUs, tokens/s of every GPU and per GPU, the
scaling efficiency (tokens/s per GPU on N / the same mode's tokens/s on one GPU, at the same
per-GPU batch and recipe: 1.0 is perfect scaling), slidekit on N GPUs against DeepSpeed on the same
N, each rank's peak host RSS and host update seconds per step (with the host's total), and each
rank's gradient-reduction and weight-gather seconds per step.

A cell with no run that measured gives its reason: a measured cause ("does not fit in GPU memory:
tried to allocate ..."; "host RAM exhausted: ..."), a failure, or "not run: time budget".
``suite_markdown`` is the whole page: the header (commit, date, device, versions, the FLOP formula,
the method), a table per recipe, the levers' ratios where a mode sets one (``levers``), slidekit's
pipeline figures, and the time plan against what each run took. Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from slidekit.tools.bench.records import FLOPS_FORMULA
from slidekit.tools.bench.suites import NO_OFFLOAD

__all__ = ["Cell", "add_ratios", "cells", "dp_table", "markdown_table", "scaling", "suite_markdown"]

ALL_RESIDENT = "slidekit (resident all)"
_OFFLOAD_ALTS = (
    ("torchao", "vs torchao"),
    ("deepspeed", "vs DeepSpeed"),
    ("deepspeed_partial", "vs DS partial"),
)


@dataclass(kw_only=True, slots=True)
class Cell:
    """Every repeat of one run label at one recipe and batch, and the figures derived from them."""

    label: str
    system: str
    clip: float | None
    batch: int
    ranks: int = 1  # GPUs of the run (data-parallel ranks)
    family: str = ""  # the label of the same run on one GPU
    ok: list[dict[str, Any]] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)
    efficiency: float | None = None
    vs_best: tuple[float, str] | None = None
    vs: dict[str, float | None] = field(default_factory=dict)

    @property
    def tokens(self) -> list[float]:
        return [r["tokens_per_s"] for r in self.ok]

    @property
    def median_tokens(self) -> float | None:
        return median(self.tokens) if self.ok else None

    def med(self, key: str) -> float | None:
        values = [r[key] for r in self.ok if r.get(key) is not None]
        return median(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [r[key] for r in self.ok if r.get(key) is not None]
        return max(values) if values else None

    @property
    def why(self) -> str:
        """The reasons of the repeats that did not measure, once each."""
        texts = []
        for r in self.other:
            status, reason = str(r.get("status")), str(r.get("reason", "?"))
            texts.append(_one_line(reason if reason.startswith(status) else f"{status}: {reason}"))
        return "; ".join(dict.fromkeys(texts))


def _one_line(text: str) -> str:
    """``text`` fit for one markdown table cell: whitespace runs (newlines of a multi-line error) as one
    space, ``|`` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def cells(rows: Sequence[dict[str, Any]]) -> list[Cell]:
    """The rows of a suite (``record`` "run") gathered into cells, ratios filled in; in first-seen order."""
    out: dict[tuple[str, float | None, int], Cell] = {}
    for r in rows:
        if r.get("record", "run") != "run":
            continue
        key = (r["label"], r.get("max_grad_norm"), r["batch"])
        cell = out.setdefault(
            key,
            Cell(
                label=r["label"],
                system=r["system"],
                clip=key[1],
                batch=key[2],
                ranks=int(r.get("ranks") or r.get("world") or 1),
                family=str(r.get("family") or r["label"]),
            ),
        )
        (cell.ok if r.get("status") == "ok" else cell.other).append(r)
    found = list(out.values())
    for cell in found:
        if cell.system != "slidekit" or cell.median_tokens is None:
            continue
        same = (cell.clip, cell.batch, cell.ranks)
        peers = [c for c in found if (c.clip, c.batch, c.ranks) == same and c.median_tokens]
        ref = next((c for c in peers if c.family == ALL_RESIDENT), None)
        cell.efficiency = (
            cell.median_tokens / ref.median_tokens if ref and ref.median_tokens else None
        )
        best = max(
            (c for c in peers if c.system in NO_OFFLOAD), key=lambda c: c.median_tokens or 0, default=None
        )
        if best is not None and best.median_tokens:
            cell.vs_best = (cell.median_tokens / best.median_tokens, best.label)
        for system, _ in _OFFLOAD_ALTS:
            cell.vs[system] = _vs_alternative(cell, found, system)
    return found


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Give every slidekit row ``vs_<system>`` = its tokens/s / that alternative's in the same batch,
    recipe and repeat (None if either has no result)."""
    for row in rows:
        if row["system"] != "slidekit":
            continue
        for other in rows:
            same = (other["batch"], other.get("max_grad_norm"), other.get("repeat")) == (
                row["batch"],
                row.get("max_grad_norm"),
                row.get("repeat"),
            )
            if other["system"] == "slidekit" or not same:
                continue
            ok = row.get("status") == "ok" and other.get("status") == "ok"
            row[f"vs_{other['system']}"] = (
                round(row["tokens_per_s"] / other["tokens_per_s"], 3) if ok else None
            )


def _f(value: float | None, fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _recipe(clip: float | None) -> str:
    return "no clipping" if clip is None else f"max_grad_norm {clip:g}"


_SYSTEM_ORDER = ("slidekit", "liger_gc", "liger", "no_offload", "torchao", "deepspeed", "deepspeed_partial")


def _order(found: Sequence[Cell]) -> dict[str, int]:
    """Row order: slidekit's modes as first seen, then the no-offload baselines, then the offload ones."""
    labels = list(dict.fromkeys(c.label for c in found))
    system = {c.label: c.system for c in found}
    rank = {s: i for i, s in enumerate(_SYSTEM_ORDER)}
    ordered = sorted(labels, key=lambda label: (rank.get(system[label], len(rank)), labels.index(label)))
    return {label: i for i, label in enumerate(ordered)}


def markdown_table(rows: Sequence[dict[str, Any]], *, clip: float | str | None = "all") -> str:
    """The table of one recipe (``clip``; "all": every recipe, one table each, under a heading).

    Rows go batch by batch; a run that measured nothing at any batch of the recipe, for the same
    reason, is one row ("all" batches) at the end instead of one per batch.
    """
    found = cells(rows)
    if clip == "all":
        recipes = list(dict.fromkeys(c.clip for c in found))
        return "\n\n".join(f"### Recipe: {_recipe(r)}\n\n" + markdown_table(rows, clip=r) for r in recipes)
    head = [
        "run",
        "batch",
        "tokens/s median [min-max] (n)",
        "TFLOPS",
        "step s",
        "peak GPU GiB",
        "peak RSS GiB",
    ]
    head += ["offload efficiency", "vs best no-offload"] + [name for _, name in _OFFLOAD_ALTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mine = [c for c in found if c.clip == clip]
    batch_rank = {b: i for i, b in enumerate(dict.fromkeys(c.batch for c in found))}
    label_rank = _order(found)
    whys: dict[str, set[str]] = {}
    for c in mine:
        whys.setdefault(c.label, set()).add("" if c.ok else c.why)
    never = {label for label, why in whys.items() if len(why) == 1 and "" not in why}
    for c in sorted(mine, key=lambda c: (batch_rank[c.batch], label_rank[c.label])):
        if c.label in never:
            continue
        if not c.ok:
            out = [c.label, str(c.batch), c.why] + ["-"] * (len(head) - 3)
        else:
            spread = f"{c.median_tokens:,.0f} [{min(c.tokens):,.0f}-{max(c.tokens):,.0f}] ({len(c.ok)})"
            if c.other:
                spread += f"; {c.why}"
            out = [c.label, str(c.batch), spread, _f(c.med("model_tflops")), _f(c.med("mean_step_s"))]
            out += [_f(c.peak("peak_gpu_gib")), _f(c.peak("peak_host_rss_gib"))]
            out.append(_f(c.efficiency, "{:.2f}") if c.system == "slidekit" else "-")
            out.append(f"{c.vs_best[0]:.2f}x ({c.vs_best[1]})" if c.vs_best else "-")
            out += [_f(c.vs.get(s), "{:.2f}x") for s, _ in _OFFLOAD_ALTS]
        lines.append("| " + " | ".join(out) + " |")
    for label in sorted(never, key=label_rank.__getitem__):
        lines.append(
            "| " + " | ".join([label, "all", next(iter(whys[label]))] + ["-"] * (len(head) - 3)) + " |"
        )
    return "\n".join(lines)


def pipeline_table(rows: Sequence[dict[str, Any]]) -> str:
    """slidekit's own figures per cell (medians over the repeats): residency, lane times, eta, GPU busy."""
    head = ["run", "recipe", "batch", "resident units", "T_fwd ms", "T_bwd ms", "T_d2h ms", "T_update ms"]
    head += ["eta", "GPU busy", "GPU busy in bwd", "setup s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells(rows):
        if c.system != "slidekit" or not c.ok:
            continue
        units = ", ".join(dict.fromkeys(str(r.get("resident_units")) for r in c.ok))
        out = [c.label, _recipe(c.clip), str(c.batch), units]
        out += [_f(c.med(f"t_{k}_s"), scale=1e3) for k in ("fwd", "bwd", "d2h", "update")]
        out += [_f(c.med("eta")), _f(c.med("gpu_busy"), "{:.2f}"), _f(c.med("gpu_busy_bwd"), "{:.2f}")]
        out.append(_f(c.med("setup_s")))
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def plan_table(rows: Sequence[dict[str, Any]]) -> str:
    """Each run's predicted seconds against its process's measured wall time (or why it did not run)."""
    runs: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("record", "run") == "run":
            runs.setdefault(r["run_name"], r)
            if r.get("process_wall_s") is not None:
                runs[r["run_name"]] = r
    lines = ["| run | predicted s | measured s |", "|---|---|---|"]
    for name, r in runs.items():
        measured = r.get("process_wall_s")
        lines.append(
            f"| {name} | {_f(r.get('predicted_s'), '{:.0f}')} | {_f(measured, '{:.0f}') if measured else _one_line(str(r.get('reason', '-')))} |"
        )
    return "\n".join(lines)


def scaling(cell: Cell, found: Sequence[Cell]) -> float | None:
    """tokens/s per GPU of ``cell`` (on N GPUs) / tokens/s of the same run on one GPU at the same per-GPU
    batch and recipe (medians over the repeats); None where either did not measure or N is 1."""
    one = next(
        (
            c
            for c in found
            if c.ranks == 1 and c.family == cell.family and (c.clip, c.batch) == (cell.clip, cell.batch)
        ),
        None,
    )
    per_gpu = cell.med("tokens_per_s_per_gpu")
    if cell.ranks == 1 or one is None or one.median_tokens is None or per_gpu is None:
        return None
    return per_gpu / one.median_tokens


def _vs_alternative(cell: Cell, found: Sequence[Cell], system: str) -> float | None:
    alt = next(
        (
            c
            for c in found
            if c.system == system and (c.clip, c.batch, c.ranks) == (cell.clip, cell.batch, cell.ranks)
        ),
        None,
    )
    if cell.system != "slidekit" or alt is None or not alt.median_tokens or cell.median_tokens is None:
        return None
    return cell.median_tokens / alt.median_tokens


def _per_rank(cell: Cell, key: str, how: str = "max") -> list[float | None]:
    """Each rank's ``key`` of the record's ``per_rank`` list, over the repeats (their max or median)."""
    values: dict[int, list[float]] = {}
    for r in cell.ok:
        for rank in r.get("per_rank") or ():
            if rank.get(key) is not None:
                values.setdefault(int(rank["rank"]), []).append(float(rank[key]))
    pick = max if how == "max" else median
    return [pick(values[r]) if r in values else None for r in range(max(values, default=-1) + 1)]


def _ranks_text(values: Sequence[float | None], fmt: str, *, total: bool = False) -> str:
    if not values:
        return "-"
    text = ", ".join(_f(v, fmt) for v in values)
    if total and len(values) > 1 and all(v is not None for v in values):
        text += f" (host {fmt.format(sum(v for v in values if v is not None))})"
    return text


def dp_table(rows: Sequence[dict[str, Any]]) -> str:
    """The data-parallel figures per cell (module docstring); rank lists in rank order."""
    found = [c for c in cells(rows) if c.ok]
    head = ["run", "recipe", "batch per GPU", "GPUs", "tokens/s", "tokens/s per GPU", "scaling efficiency"]
    head += ["vs DeepSpeed (same GPUs)", "peak host RSS GiB per rank", "host update s/step per rank"]
    head += ["t_reduce s/step per rank", "t_gather s/step per rank"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = _order(found)
    for c in sorted(found, key=lambda c: (c.clip is not None, c.clip or 0.0, c.batch, order[c.label])):
        rss = _per_rank(c, "peak_host_rss_gib")
        rss_text = _ranks_text(rss, "{:.1f}", total=True)
        if not rss:  # an alternative: its process tree's peak, every rank together (the memory watchdog's)
            rss_text = f"{_f(c.peak('process_peak_rss_gib'), '{:.1f}')} (all ranks)"
        spread = f"{c.median_tokens:,.0f} [{min(c.tokens):,.0f}-{max(c.tokens):,.0f}] ({len(c.ok)})"
        out = [c.label, _recipe(c.clip), str(c.batch), str(c.ranks), spread]
        out += [_f(c.med("tokens_per_s_per_gpu") or c.median_tokens, "{:,.0f}")]
        out += [_f(scaling(c, found), "{:.2f}"), _f(_vs_alternative(c, found, "deepspeed"), "{:.2f}x")]
        out += [rss_text, _ranks_text(_per_rank(c, "update_s", "median"), "{:.3f}", total=True)]
        out += [_ranks_text(_per_rank(c, f"{lane}_s", "median"), "{:.3f}") for lane in ("reduce", "gather")]
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def _calls_line(header: Mapping[str, Any]) -> str:
    """Which commit and how many ``slidekit bench`` calls measured the suite (``--continue`` adds calls)."""
    calls = header.get("calls") or []
    if len(calls) < 2:
        return f"Commit `{header.get('commit')}`, {header.get('date')}, one `slidekit bench` call"
    commits = list(dict.fromkeys(str(c.get("commit")) for c in calls))
    hosts = len({c.get("boot_id") for c in calls if c.get("boot_id")})
    dates = f"{calls[0].get('date')} to {calls[-1].get('date')}"
    if hosts > 1:  # --other-host: say it
        dates += f"; on {hosts} hosts of one kind, continued with --other-host"
    digest = str(header.get("source_digest"))[:12]
    if len(commits) == 1:
        return f"Commit `{commits[0]}`, {len(calls)} `slidekit bench` calls ({dates})"
    named = ", ".join(f"`{c}`" for c in commits)
    return (
        f"Commits {named} (the same slidekit/ and plugins/, source digest {digest}), "
        f"{len(calls)} `slidekit bench` calls ({dates})"
    )


def suite_markdown(header: dict[str, Any], rows: Sequence[dict[str, Any]], *, records_name: str) -> str:
    """The suite's page (module docstring). ``header``: the suite's first JSONL record."""
    runs = [r for r in rows if r.get("record", "run") == "run"]
    ok = [r for r in runs if r.get("status") == "ok"]
    params = next((r["params"] for r in ok if r.get("params")), None)
    size = f" ({params / 1e9:.2f} B parameters)" if params and params >= 1e8 else ""
    size = f" ({params / 1e6:.1f} M parameters)" if params and params < 1e8 else size
    gpus = sorted({str(r["gpu"]) for r in ok if r.get("gpu")}) or sorted({str(r.get("device")) for r in ok})
    v = header.get("versions", {})
    versions = ", ".join(f"{k} {v[k]}" for k in v if v[k]) or "unknown"
    m = header.get("machine") or {}
    host = f" (host: {m.get('cpu_model')}, {m.get('cpus')} CPUs, {m.get('host_ram_gib')} GiB RAM)" if m else ""
    s = header.get("suite", {})
    lines = [
        f"## Suite {header.get('name')}: {header.get('model')}{size}, seq {s.get('seq')}",
        "",
        f"{_calls_line(header)}; measured on "
        f"{', '.join(gpus) or 'nothing (no run measured)'}{host}; {versions}. Raw records: "
        f"[{records_name}]({records_name}).",
        "",
        f"Each cell: tokens/s of {s.get('steps')} consecutive timed steps after {s.get('warmup')} warm-up "
        "steps in the same process, timed start to start, the last ending with every update applied and "
        "the device idle (the period, not a median step); the median over the repeats, each in its own "
        "process, with [min-max] and (n) repeats. Model TFLOPS: " + FLOPS_FORMULA + ". Offload efficiency: "
        "tokens/s / slidekit all-resident's at the same batch and recipe (same kernels). vs best "
        "no-offload: slidekit / the fastest of HF + Liger (GC), HF + Liger (no GC) and HF (GC) at the "
        "same batch and recipe (named). Method: docs/benchmarking.md.",
    ]
    if s.get("note"):
        lines += ["", f"Note: {s['note']}."]
    lines += ["", markdown_table(runs), ""]
    from slidekit.tools.bench.levers import levers_markdown  # it builds on this module's cells

    if levers := levers_markdown(runs):
        lines += [levers]
    if any(int(r.get("ranks") or r.get("world") or 1) > 1 for r in runs):
        lines += [
            "### Data parallelism (per-GPU batch; scaling efficiency against the same run on one GPU)",
            "",
        ]
        lines += [dp_table(runs), ""]
    lines += ["### slidekit's pipeline (medians over the repeats)", ""]
    lines += [pipeline_table(runs), "", "### The time plan against what each run took", ""]
    budget = f"{header['budget_s']:.0f} s" if header.get("budget_s") else "none"
    builds = ", ".join(
        f"{name} {'ok' if b.get('ok') else 'failed (' + str(b.get('failure')) + ')'} in {b.get('wall_s')} s"
        for name, b in (header.get("builds") or {}).items()
    )
    lines += [f"Budget: {budget}; built before the runs: {builds or 'nothing'}.", ""]
    lines += [plan_table(runs), ""]
    return "\n".join(lines)
