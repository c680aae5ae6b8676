"""The logger plugins (plugins/slidekit_logging), read back through their own libraries' readers.

TensorBoard: the event files in RUN_DIR/tensorboard, loaded by TensorBoard's ``EventAccumulator``,
hold every scalar of every step at its step number with the values metrics.jsonl has, and a
resumed run replaces (``purge_step``) what the first run logged after the checkpoint it resumed
from. W&B: the offline run in RUN_DIR/wandb, read by ``wandb leet inspect --json`` (W&B's reader
of its ``.wandb`` transaction log), holds the configuration, the same history and the last
checkpoint in its summary; a resumed run continues the same W&B run id. W&B runs offline here:
``WANDB_MODE=offline``, its directories under tmp_path, no stats, no git, no code saving.

Also: ``run.report_to`` is validated (names, "none" and "all", a run directory), a name no logger
plugin answers to is refused before anything is built, a logger whose library is missing stops the
run before its first step with ``pip install 'slidekit[...]'`` (a warning under "all"), the
loggers write nothing unless asked, and pyproject registers both as entry points.

Test: ``pytest tests/test_logging_plugins.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from slidekit import DataConfig, EngineConfig, Plugins, RunConfig, TrainConfig, Trainer
from slidekit.config import from_dict
from slidekit.errors import ConfigError, DriverUnavailableError
from slidekit.hookspecs import hookimpl
from slidekit.reporting import SCALARS
from slidekit_logging import tensorboard as tb_plugin
from slidekit_logging import wandb as wandb_plugin

ROOT = Path(__file__).resolve().parents[1]
#: The drivers a CPU run of the demo needs; the loggers come in through ``extra`` (with entry points
#: loaded, CI's editable install would register the same modules a second time).
DRIVERS = ["ram", "layer_adam", "torch_ref"]


def _plugins(*extra: tuple[str, object]) -> Plugins:
    return Plugins(entry_points=DRIVERS, extra=[("tensorboard", tb_plugin), ("wandb", wandb_plugin), *extra])


def _config(run_dir: Path, report_to: str, *, steps: int = 4, resume: bool | int = False) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=16, batch_size=2, eval_fraction=0.01, eval_every=2),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run_dir), checkpoint_every=2, resume=resume, report_to=report_to),
        steps=steps,
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


#: The libraries are optional extras (both in ``test``; the GPU machine's image has TensorBoard, not W&B).
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed (slidekit[tensorboard])"
)
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (slidekit[wandb])"
)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline and hermetic: every directory it uses under tmp_path, nothing it can skip."""
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB__DISABLE_STATS": "true",  # settings x_disable_stats, x_disable_meta
        "WANDB__DISABLE_META": "true",
    }.items():
        monkeypatch.setenv(var, value)
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


# --------------------------------------------------------------------------- TensorBoard


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def _expected(metrics: list[dict], tag: str) -> list[tuple[int, float]]:
    key = next(k for k, t in SCALARS.items() if t == tag)
    return [(m["step"], m[key]) for m in metrics if key in m]


@needs_tensorboard
def test_tensorboard_event_files_hold_every_step_and_a_resume_replaces_the_steps_it_redoes(tmp_path):
    run = tmp_path / "run"
    with Trainer(_config(run, "tensorboard"), plugins=_plugins()) as t:
        t.fit()
    first = _metrics(run)
    logged = _scalars(run / "tensorboard")
    assert set(logged) == {t for k, t in SCALARS.items() if k in first[0] or k in first[1]}
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(logged)
    assert "memory/host_rss_gib" in logged and "pipeline/hiding_factor" in logged
    for tag, points in logged.items():
        want = _expected(first, tag)
        assert [s for s, _ in points] == [s for s, _ in want], tag
        assert [v for _, v in points] == pytest.approx([v for _, v in want], rel=1e-6), tag  # float32 there
    assert [s for s, _ in logged["eval/loss"]] == [2, 4]
    saved = _texts(run / "tensorboard", "checkpoints")
    assert [s for s, _ in saved] == [2, 4] and str(run / "checkpoints" / "step-00000004") in saved[1][1]
    assert '"report_to"' in _texts(run / "tensorboard", "config")[0][1]

    # Resumed from step 2: steps 3 and 4 are logged again, and TensorBoard shows each step once.
    with (
        pytest.warns(RuntimeWarning, match="moved them aside"),  # the first run's checkpoint of step 4
        Trainer(_config(run, "tensorboard", resume=2), plugins=_plugins()) as t,
    ):
        t.fit()
    again = _scalars(run / "tensorboard")
    assert [s for s, _ in again["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in again["train/loss"]] == pytest.approx([m["loss"] for m in _metrics(run)], rel=1e-6)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2


# --------------------------------------------------------------------------- W&B


def _wandb_records(run_file: Path) -> list[dict]:
    """The records of a ``.wandb`` transaction log, by W&B's own reader (``wandb leet inspect --json``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # the timeout only turns a hang into a failure
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def _history(records: list[dict]) -> dict[int, dict]:
    return {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}


def _summary(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        if r["type"] == "summary":
            out.update(r["summary"].get("update", {}))
    return out


@needs_wandb
def test_wandb_offline_run_holds_the_config_every_step_and_the_last_checkpoint(tmp_path, wandb_offline):
    run = tmp_path / "run"
    with Trainer(_config(run, "wandb"), plugins=_plugins()) as t:
        t.fit()
    first = _metrics(run)
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    run_id = (run / "wandb" / wandb_plugin.RUN_ID_FILE).read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"
    records = _wandb_records(run_file)
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert start["run_id"] == run_id and start["project"] == "slidekit"
    config = start["config"]["update"]
    assert config["steps"] == 4 and config["run"]["report_to"] == ["wandb"]
    history = _history(records)
    assert sorted(history) == [1, 2, 3, 4]
    for m in first:
        row = history[m["step"]]
        for key, tag in SCALARS.items():
            if key in m:
                assert row[tag] == pytest.approx(m[key], rel=1e-12), (m["step"], tag)
            else:
                assert tag not in row, (m["step"], tag)
    assert [s for s in history if "eval/loss" in history[s]] == [2, 4]
    summary = _summary(records)
    assert summary["checkpoint/step"] == 4
    assert summary["checkpoint/path"] == str(run / "checkpoints" / "step-00000004")
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]

    # Resumed from step 2: the same W&B run id continues with steps 3 and 4.
    with (
        pytest.warns(RuntimeWarning, match="moved them aside"),  # the first run's checkpoint of step 4
        Trainer(_config(run, "wandb", resume=2), plugins=_plugins()) as t,
    ):
        t.fit()
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    (resumed,) = [f for f in files if f != run_file]
    history = _history(_wandb_records(resumed))
    assert sorted(history) == [3, 4]
    assert [history[s]["train/loss"] for s in (3, 4)] == [m["loss"] for m in _metrics(run)[2:]]


# --------------------------------------------------------------------------- asking for loggers


class Recorder:
    """A plugin that records the lifecycle hooks it sees."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    @hookimpl
    def slidekit_fit_start(self, steps_done):
        self.calls.append(("fit_start", steps_done))

    @hookimpl
    def slidekit_step_end(self, step):
        self.calls.append(("step_end", step))

    @hookimpl
    def slidekit_fit_end(self, steps, error):
        self.calls.append(("fit_end", (steps, type(error).__name__ if error else None)))


class Lifecycle:
    """A plugin that records every lifecycle hook with what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def slidekit_fit_start(self, config, drivers, steps_done):
        self.calls.append(("fit_start", steps_done, config.steps, sorted(drivers)))

    @hookimpl
    def slidekit_evaluate(self, step, metrics):
        self.calls.append(("evaluate", step, dict(metrics)))

    @hookimpl
    def slidekit_step_end(self, step, metrics):
        self.calls.append(("step_end", step, metrics.get("eval_loss")))

    @hookimpl
    def slidekit_checkpoint_saved(self, step, path):
        # committed by an atomic rename: the directory exists once the checkpoint is complete
        self.calls.append(("checkpoint_saved", step, path, (path / "manifest.json").is_file()))

    @hookimpl
    def slidekit_fit_end(self, steps, error):
        self.calls.append(("fit_end", steps, error))


def test_lifecycle_hooks_see_evaluations_checkpoints_and_the_steps_already_done(tmp_path):
    run = tmp_path / "run"
    hooks = Lifecycle()
    with Trainer(_config(run, "none"), plugins=_plugins(("lifecycle", hooks))) as t:
        t.fit()
    metrics = _metrics(run)
    start, *steps, end = hooks.calls
    assert start == ("fit_start", 0, 4, ["kernels", "optimizer", "state_tier"]) and end == (
        "fit_end",
        4,
        None,
    )
    evals = [(c[1], c[2]) for c in steps if c[0] == "evaluate"]
    assert evals == [(m["step"], {"eval_loss": m["eval_loss"]}) for m in metrics if "eval_loss" in m]
    assert [c[1] for c in steps if c[0] == "evaluate"] == [2, 4]
    assert [(c[1], c[2]) for c in steps if c[0] == "step_end"] == [
        (m["step"], m.get("eval_loss")) for m in metrics
    ]
    saved = [c for c in steps if c[0] == "checkpoint_saved"]
    assert [(s, p) for _, s, p, _ in saved] == [(s, run / "checkpoints" / f"step-{s:08d}") for s in (2, 4)]
    assert all(complete for *_, complete in saved)  # on disk when reported
    # Each checkpoint is reported after the step that took it, and the evaluation before its step's end.
    order = [(c[0], c[1]) for c in steps]
    assert order.index(("checkpoint_saved", 2)) > order.index(("step_end", 2))
    assert order.index(("evaluate", 4)) < order.index(("step_end", 4)) < order.index(("checkpoint_saved", 4))

    hooks.calls.clear()
    with (
        pytest.warns(RuntimeWarning, match="moved them aside"),
        Trainer(_config(run, "none", resume=2), plugins=_plugins(("lifecycle", hooks))) as t,
    ):
        t.fit()
    assert hooks.calls[0] == ("fit_start", 2, 4, ["kernels", "optimizer", "state_tier"])
    assert [c[1] for c in hooks.calls if c[0] == "step_end"] == [3, 4]


@pytest.mark.parametrize(
    ("logger", "module", "extra"),
    [("tensorboard", "torch.utils.tensorboard", "tensorboard"), ("wandb", "wandb", "wandb")],
)
def test_a_logger_whose_library_is_missing_stops_the_run_before_its_first_step(
    tmp_path, monkeypatch, wandb_offline, logger, module, extra
):
    monkeypatch.setitem(sys.modules, module, None)  # the import fails, as where it is not installed
    recorder = Recorder()
    trainer = Trainer(_config(tmp_path / "run", logger), plugins=_plugins(("recorder", recorder)))
    with pytest.raises(DriverUnavailableError, match=rf"names {logger!r}.*pip install 'slidekit\[{extra}\]'"):
        trainer.fit()
    assert recorder.calls == [("fit_start", 0), ("fit_end", (0, "DriverUnavailableError"))]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


@needs_tensorboard
def test_all_takes_the_loggers_that_are_installed(tmp_path, monkeypatch, wandb_offline):
    monkeypatch.setitem(sys.modules, "wandb", None)
    run = tmp_path / "run"
    with (
        Trainer(_config(run, "all", steps=2), plugins=_plugins()) as t,
        pytest.warns(RuntimeWarning, match=r"'all': Weights & Biases \(wandb\) is not installed"),
    ):
        t.fit()
    assert [s for s, _ in _scalars(run / "tensorboard")["train/loss"]] == [1, 2]
    assert not (run / "wandb").exists()


def test_the_loggers_write_nothing_unless_asked(tmp_path, wandb_offline):
    run = tmp_path / "run"
    with Trainer(_config(run, "none", steps=2), plugins=_plugins()) as t:
        t.fit()
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "run.lock",
    ]


@pytest.mark.parametrize(
    ("report_to", "plugins", "match"),
    [
        ("tensorbord", lambda: _plugins(), r"names 'tensorbord', but no plugin of that name is loaded"),
        ("wandb", lambda: Plugins(entry_points=DRIVERS), r"names 'wandb', but no plugin of that name"),
        (
            "wandb",
            lambda: Plugins(entry_points=DRIVERS, block=["wandb"], extra=[("wandb", wandb_plugin)]),
            r"names 'wandb', but that plugin is blocked",
        ),
        ("ram", lambda: _plugins(), r"names 'ram', but the plugin of that name is not a logger"),
    ],
)
def test_a_name_no_logger_answers_to_is_refused_before_anything_is_built(tmp_path, report_to, plugins, match):
    with pytest.raises(ConfigError, match=rf"run\.report_to \(CLI: --report-to\) {match}"):
        Trainer(_config(tmp_path / "run", report_to), plugins=plugins())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("none", ()),
        ("", ()),
        ((), ()),
        ("tensorboard", ("tensorboard",)),
        ("TensorBoard, wandb", ("tensorboard", "wandb")),
        (["wandb", "tensorboard", "wandb"], ("wandb", "tensorboard")),
        ("all", ("all",)),
    ],
)
def test_report_to_takes_names_a_comma_list_or_a_list(tmp_path, given, stored):
    run = RunConfig(dir=str(tmp_path), report_to=given)
    assert run.report_to == stored
    cfg = TrainConfig(run=run)
    assert from_dict(cfg.to_dict()) == cfg  # what a run saves reads back the same


@pytest.mark.parametrize(
    ("run", "match"),
    [
        (dict(report_to="none,wandb"), r"run\.report_to .* = 'none,wandb': 'none' stands alone"),
        (dict(report_to="all,wandb"), r"'all' stands alone"),
        (dict(report_to="tensor board"), r"holds 'tensor board', not a logger name"),
        (dict(report_to=3), r"run\.report_to must be a string or a list of strings, got 3"),
        (
            dict(dir=None, report_to="tensorboard"),
            r"run\.report_to = 'tensorboard' writes the logs in the run",
        ),
    ],
)
def test_bad_report_to_values_are_refused_naming_them(tmp_path, run, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(**{"dir": str(tmp_path), **run})


def test_the_command_line_takes_report_to():
    from slidekit.cli import build_parser, config_from_args

    args = build_parser().parse_args(["finetune", "--run-dir", "r", "--report-to", "tensorboard,wandb"])
    assert config_from_args(args).run.report_to == ("tensorboard", "wandb")


def test_pyproject_registers_the_loggers_as_entry_points():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    entry_points = project["entry-points"]["slidekit"]
    for name in ("tensorboard", "wandb"):
        assert entry_points[name] == f"slidekit_logging.{name}"
        module = importlib.import_module(entry_points[name])
        assert {"slidekit_fit_start", "slidekit_step_end", "slidekit_fit_end"} <= set(vars(module))
    extras = project["optional-dependencies"]
    assert extras["tensorboard"] == ["tensorboard>=2.16"] and extras["wandb"] == ["wandb>=0.17"]
    assert "slidekit[tensorboard,wandb]" in extras["test"]
