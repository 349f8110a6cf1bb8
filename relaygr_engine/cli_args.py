"""What every ``relaygr`` command line shares: a parser whose mistakes are one-line usage errors, and one
argument validator per kind of argument.

A mistake on the command line ends as ``PROG: error: argument --flag: expected ..., got ...`` on one line of
stderr with exit status 2 (argparse's own ``error``), before any work starts. The validators are argparse
``type=`` callables raising :class:`argparse.ArgumentTypeError`, so argparse names the user's flag; mistakes that
involve several flags (or a file's contents) go through :meth:`ArgumentParser.error` with the flags named.
"""
from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import math
import os
import re
from typing import NoReturn, Optional, Sequence

__all__ = ["ArgumentParser", "HelpFormatter", "Number", "COUNT", "POSITIVE_INT", "NON_NEGATIVE", "POSITIVE",
           "NumberList", "POSITIVE_INTS", "existing_file", "json_object", "device", "ChoiceList", "require_modules",
           "add_model_arguments", "model_shape"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where a default says something (not for ``None`` or a flag without a value)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or action.nargs == 0 or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose usage errors are one line: ``PROG: error: MESSAGE (PROG --help)``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


class Number:
    """An argparse type: an ``int`` or finite ``float`` in ``[low, inf)`` (``(low, inf)`` with ``low_open``)."""

    def __init__(self, kind: type = float, low: float = -math.inf, low_open: bool = False) -> None:
        assert kind in (int, float), kind
        self.kind, self.low, self.low_open = kind, low, low_open
        noun = "an integer" if kind is int else "a number"
        bound = "" if low == -math.inf else f" {'>' if low_open else '>='} {low:g}"
        self.expected = noun + bound
        self.__name__ = self.expected  # what argparse prints for a value this type refuses

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}") from None
        below = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or below:
            raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text}")
        return value

    def __repr__(self) -> str:
        return f"Number({self.expected})"


COUNT = Number(int, 0)
POSITIVE_INT = Number(int, 1)
NON_NEGATIVE = Number(float, 0.0)
POSITIVE = Number(float, 0.0, low_open=True)


class NumberList:
    """An argparse type: comma-separated values, each checked by a :class:`Number` (at least one value)."""

    def __init__(self, item: Number) -> None:
        self.item = item
        self.__name__ = f"comma-separated list of {item.expected}"

    def __call__(self, text: str) -> list:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        try:
            values = [self.item(t) for t in parts]
        except argparse.ArgumentTypeError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, each {self.item.expected}, "
                                             f"got {text!r}")
        return values


POSITIVE_INTS = NumberList(POSITIVE_INT)


def existing_file(text: str) -> str:
    """An argparse type: the path of a readable file."""
    if not os.path.isfile(text):
        what = "a directory" if os.path.isdir(text) else "no such file"
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} ({what})")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (permission denied)")
    return text


def json_object(text: str) -> dict:
    """An argparse type: a JSON object given inline or as the path of a ``.json`` file."""
    try:
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                value = json.load(f)
        else:
            value = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object or a path to one, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def device(text: str) -> str:
    """An argparse type: a torch device string (``cpu``, ``cuda``, ``cuda:N``, ``npu[:N]``) present here."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:0, got {text!r}") from None
    if dev.type == "cpu":
        return text
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"got {text!r} but this torch ({torch.__version__}) sees no CUDA device; use cpu")
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"got {text!r} but only {count} CUDA device(s) are visible")
        return text
    if dev.type == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise argparse.ArgumentTypeError(f"got {text!r} but torch_npu is not installed; use cpu")
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda[:N] or npu[:N], got {text!r}")


class ChoiceList:
    """An argparse type: comma-separated values of an ``enum.Enum`` (at least one; duplicates dropped)."""

    def __init__(self, choices: type[enum.Enum]) -> None:
        self.choices = choices
        self.__name__ = "list"

    def __call__(self, text: str) -> list[str]:
        valid = [m.value for m in self.choices]
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        bad = [s for s in items if s not in valid]
        if bad or not items:
            got = ", ".join(repr(s) for s in bad) if bad else repr(text)
            raise argparse.ArgumentTypeError(f"expected comma-separated values from {', '.join(valid)}, got {got}")
        return items


def require_modules(parser: argparse.ArgumentParser, modules: Sequence[str], extra: str, why: str) -> None:
    """Stop with a usage error naming the install command when one of ``modules`` cannot be imported.

    Called before any work, so a run never fails at its end for a missing optional dependency.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        parser.error(f"{why} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
                     f"installed: pip install 'relaygr-engine[{extra}]'")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model-size options every benchmark shares: ``--model PRESET`` (one of
    :data:`relaygr_engine.models.presets.PRESETS`) and ``--layers/--hidden/--heads/--head-dim/--dtype`` replacing
    its sizes; :func:`model_shape` resolves them."""
    from .models.presets import PRESETS, ModelPreset

    names = ", ".join(f"{p.value} ({s.describe()})" for p, s in PRESETS.items())
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=ModelPreset.SMALL.value, choices=[p.value for p in ModelPreset],
                   help=f"model size preset: {names}")
    g.add_argument("--layers", type=POSITIVE_INT, help="layers (default: the preset's)")
    g.add_argument("--hidden", type=POSITIVE_INT,
                   help="hidden width (default: the preset's, or --heads x --head-dim when either is given)")
    g.add_argument("--heads", type=POSITIVE_INT, help="attention heads (default: the preset's)")
    g.add_argument("--head-dim", type=POSITIVE_INT, help="head dimension (default: the preset's)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="weights and KV pages (default: the preset's)")


def model_shape(parser: argparse.ArgumentParser, args):
    """The :class:`~relaygr_engine.models.presets.ModelShape` the options of :func:`add_model_arguments` name;
    a size the shape refuses is a usage error naming its flag."""
    from .models.presets import shape_of

    try:
        return shape_of(args.model, num_layers=args.layers, hidden_dim=args.hidden, num_heads=args.heads,
                        head_dim=args.head_dim, dtype=args.dtype)
    except ValueError as e:
        parser.error(in_flags(parser, str(e).replace("num_layers", "layers").replace("hidden_dim", "hidden")
                              .replace("num_heads", "heads")))


def in_flags(parser: argparse.ArgumentParser, message: str) -> str:
    """``message`` (from a config object's check) with each option's field name replaced by its flag, so that a
    usage error speaks in what the user typed (``max_json_depth`` -> ``--max-json-depth``)."""
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if flags and action.dest != "help":
            message = re.sub(rf"(?<![\w-]){re.escape(action.dest)}\b", flags[0], message)
    return message
