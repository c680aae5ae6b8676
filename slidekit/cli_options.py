"""The option machinery of the command line: HF names, defaults in ``--help``, "did you mean".

``slidekit.cli.FLAGS`` says which flag sets which ``TrainConfig`` field; this module turns that
table into argparse options:

* every option's help ends with its default, read from ``TrainConfig()`` ("(default: 150)"; an
  unset value says what unset means: "(default: the sample corpus)");
* ``ALIASES``: the names transformers' ``TrainingArguments`` (and TRL) users know, accepted for the
  slidekit flag whose meaning is exactly theirs (``--learning-rate`` for ``--lr``), also in HF's
  underscore spelling (``--learning_rate``); ``--help`` shows them beside the flag ("also
  --learning-rate"). Giving two names of one option is refused;
* an unknown option exits with status 2 and the closest name: "unrecognized option --learnig-rate;
  did you mean --learning-rate?" (or, for an HF option slidekit does not take, why not: ``NOT_TAKEN``).

Test: ``pytest tests/test_cli.py``.
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from slidekit.config import TrainConfig

__all__ = ["ALIASES", "NOT_TAKEN", "OptionParser", "add_flags", "given_values"]

#: HF / TRL name -> the slidekit flag it is accepted for: only where the meaning is exactly that of
#: transformers' ``TrainingArguments`` (checked against transformers 5.x), so the same value lands on
#: the same setting. Flags named as HF names them already: --warmup-steps, --warmup-ratio,
#: --weight-decay, --max-grad-norm (0 turns clipping off, as in HF), --seed, --report-to.
ALIASES: dict[str, str] = {
    # "The initial learning rate for the optimizer": the peak rate the schedule scales.
    "--learning-rate": "--lr",
    # Micro-batches per optimizer step.
    "--gradient-accumulation-steps": "--grad-accum",
    # The run's optimizer steps. A positive number: HF's -1 ("train by epochs") is refused.
    "--max-steps": "--steps",
    # Rows per micro-batch on the (one) device; with packing (TRL's packing=True) a row is a packed sequence.
    "--per-device-train-batch-size": "--batch-size",
    # A checkpoint every N steps, and one at the end; a whole number (HF's ratio form, a float < 1, is not).
    "--save-steps": "--checkpoint-every",
    # Checkpoints kept, the older ones deleted (HF's default None keeps all; slidekit's keeps 2).
    "--save-total-limit": "--keep",
    # Steps between evaluations; evaluating at all needs --eval-fraction (HF: eval_strategy="steps").
    "--eval-steps": "--eval-every",
    # Where the checkpoints go and where a resume finds them. The final model in HF format goes to --export.
    "--output-dir": "--run-dir",
    # Mixed precision in bfloat16 (FP32 masters): --bf16 [true|false] is --dtype bfloat16 (false: float32).
    "--bf16": "--dtype",
    # The schedules both have: linear and cosine (to 0, or --min-lr-ratio in a config), constant and
    # constant_with_warmup (HF's "constant" has no warm-up; slidekit's applies --warmup-steps if given).
    "--lr-scheduler-type": "--schedule",
    # TRL's model argument, for a local model directory (a Hub id is not downloaded).
    "--model-name-or-path": "--model",
    # HF's epochs may be fractional; --epochs decides what it takes. Registered only once
    # slidekit.cli.FLAGS has --epochs: an alias whose flag does not exist is left out (tested).
    "--num-train-epochs": "--epochs",
}

#: HF options slidekit does not take, and why: what an unknown-option error says instead of a guess.
#: (HF's --optim is left to argparse: it abbreviates --optimizer, whose error lists slidekit's drivers.)
NOT_TAKEN: dict[str, str] = {
    "--fp16": "slidekit computes in bfloat16 or float32 (--dtype, or --bf16), never in float16",
    "--adam-beta1": "set optim.betas in a --config file",
    "--adam-beta2": "set optim.betas in a --config file",
    "--adam-epsilon": "set optim.eps in a --config file",
    "--resume-from-checkpoint": (
        "an HF checkpoint is not a slidekit one: --resume RUN_DIR continues a slidekit run "
        "(or --run-dir RUN_DIR --resume [STEP|PATH])"
    ),
    "--gradient-checkpointing": (
        "slidekit always recomputes each layer from its saved input during the backward pass: "
        "there is nothing to switch on"
    ),
}

#: What an unset (None) default means, per field.
_UNSET = {
    "data.path": "the sample corpus",
    "optim.lr": "2e-3 for the demo model, 2e-5 otherwise",
    "optim.max_grad_norm": "off",
    "engine.state_offload_tier": "none",
    "engine.offload_dir": "none",
    "run.dir": "none, nothing is kept",
    "run.export_dir": "no export",
    "run.trace": "no trace",
    "steps": "150",  # with --epochs: ceil(epochs x steps per epoch)
    "epochs": "none, --steps decides",
    "model.tokenizer": "the model directory's",
}

_GIVEN = "_given_by"  # namespace attribute: field -> the option string that set it
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bf16(value: str) -> str:
    text = value.strip().lower()
    if text in _TRUE:
        return "bfloat16"
    if text in _FALSE:
        return "float32"
    raise ValueError(f"takes true or false, got {value!r}")


_SCHEDULES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}


def _schedule(value: str) -> str:
    if value not in _SCHEDULES:
        raise ValueError(
            f"{value!r} has no slidekit schedule; the ones slidekit shares with HF: {', '.join(_SCHEDULES)}"
        )
    return _SCHEDULES[value]


def _grad_norm(value: float) -> float | None:
    return None if value == 0 else value  # HF: "Set to 0 to disable"


def _whole_steps(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        fraction = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    hint = f"; for a fraction of the run's steps use --warmup-ratio {text}" if 0 < fraction < 1 else ""
    raise argparse.ArgumentTypeError(f"{text} is not a whole number of steps{hint}")


#: Conversions by option string: the value as typed (after the flag's type) -> the field's value.
_CONVERT: dict[str, Callable[[Any], Any]] = {
    "--bf16": _bf16,
    "--lr-scheduler-type": _schedule,
    "--max-grad-norm": _grad_norm,
}
#: Flags whose type is not the one FLAGS gives (a clearer refusal).
_TYPES: dict[str, Callable[[str], Any]] = {"--warmup-steps": _whole_steps}


class _Set(argparse.Action):
    """Stores an option's value in its field (through ``_CONVERT``); two names of one option are refused."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name = option_string or self.dest
        given: dict[str, str] = namespace.__dict__.setdefault(_GIVEN, {})
        before = given.get(self.dest)
        if before is not None and _canonical(before) != _canonical(name):
            raise argparse.ArgumentError(self, f"{before} is given too, and sets the same option: give one")
        value = self.const if self.nargs == 0 else values
        convert = _CONVERT.get(_canonical(name))
        if convert is not None and value is not None:
            try:
                value = convert(value)
            except ValueError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
        given[self.dest] = name
        setattr(namespace, self.dest, value)


def _canonical(option: str) -> str:
    """``--learning_rate`` -> ``--learning-rate``: HF's underscore spelling is the same option."""
    return "--" + option[2:].replace("_", "-")


def _spellings(flag: str) -> list[str]:
    underscored = "--" + flag[2:].replace("-", "_")
    return [flag] if underscored == flag else [flag, underscored]


def _default_text(path: str, kind: Any) -> str:
    value: Any = TrainConfig().to_dict()
    for part in path.split("."):
        value = value[part]
    if kind in ("flag", "noflag"):
        return "on" if value == (kind == "flag") else "off"  # "noflag" turns a True default off
    if kind == "optional":
        return "off" if value is False else str(value)
    if value is None or value == []:
        return _UNSET.get(path, "none")
    return format(value, "g") if isinstance(value, float) else str(value)


def add_flags(parser: argparse.ArgumentParser, flags: Mapping[str, tuple[str, Any, str]]) -> None:
    """Add ``flags`` (``slidekit.cli.FLAGS``) to ``parser``, with their defaults, HF spellings and aliases."""
    aliases: dict[str, list[str]] = {}
    for alias, flag in ALIASES.items():
        if flag in flags:  # an alias of a flag that does not exist (yet) is left out
            aliases.setdefault(flag, []).append(alias)
    for flag, (path, kind, text) in flags.items():
        also = aliases.get(flag, [])
        shown = text if "(default" in text else f"{text} (default: {_default_text(path, kind)})"
        if also:
            shown += f"; also {', '.join(also)}"
        _add(parser, flag, path, kind, shown.replace("%", "%%"), flag)
        hidden = _spellings(flag)[1:] if flag in _HF_NAMED else []
        for alias in also:
            hidden += _spellings(alias)
        for name in hidden:  # the same option under another name, not listed again
            _add(parser, name, path, "bool" if name == "--bf16" else kind, argparse.SUPPRESS, flag)


#: Flags that have HF's name already, so take its underscore spelling too.
_HF_NAMED = ("--warmup-steps", "--warmup-ratio", "--weight-decay", "--max-grad-norm", "--report-to")


def _add(parser: argparse.ArgumentParser, name: str, path: str, kind: Any, text: str, flag: str) -> None:
    """Option ``name`` setting field ``path``; ``kind`` as in FLAGS, or "bool" (``--bf16 [true|false]``)."""
    common: dict[str, Any] = {"dest": path, "action": _Set, "default": None, "help": text}
    if kind in ("flag", "noflag"):
        parser.add_argument(name, nargs=0, const=kind == "flag", **common)
    elif kind == "optional":
        parser.add_argument(name, nargs="?", const=True, metavar="RUN_DIR|STEP|PATH", **common)
    elif kind == "bool":
        parser.add_argument(name, nargs="?", const="true", metavar="BOOL", **common)
    else:
        metavar = path.rpartition(".")[2].upper()
        parser.add_argument(name, type=_TYPES.get(flag, kind), metavar=metavar, **common)


def given_values(args: argparse.Namespace, flags: Mapping[str, tuple[str, Any, str]]) -> dict[str, Any]:
    """field -> value of every option the command line gave (a value may be None: ``--max-grad-norm 0``)."""
    given = getattr(args, _GIVEN, {})
    out = {}
    for path, _, _ in flags.values():
        value = getattr(args, path, None)
        if path in given or value is not None:
            out[path] = value
    return out


class _Formatter(argparse.HelpFormatter):
    """argparse's help, never breaking a line inside an option's name (--save-total-limit)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser whose unknown options get the closest known name, or why slidekit lacks them;
    its help lines keep option names whole. Subcommands' parsers are OptionParsers too."""

    commands: Mapping[str, argparse.ArgumentParser]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            parser = getattr(self, "commands", {}).get(command, self)
            _refuse_unknown(parser, extras)
        return parsed


def _refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> NoReturn:
    known = [o for a in parser._actions for o in a.option_strings]  # argparse has no public accessor
    problems = []
    for token in extras:
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        if _canonical(name) in NOT_TAKEN:
            problems.append(f"unrecognized option {name}: {NOT_TAKEN[_canonical(name)]}")
            continue
        close = difflib.get_close_matches(name, known, n=1)
        problems.append(f"unrecognized option {name}" + (f"; did you mean {close[0]}?" if close else ""))
    parser.error("; ".join(problems) if problems else f"unrecognized arguments: {' '.join(extras)}")
