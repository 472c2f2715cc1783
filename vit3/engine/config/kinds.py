"""The kinds of constraint of the validation layer (:mod:`vit3.engine.config.schema`) and how its messages
read.

:class:`Range`, :class:`Choice`, :class:`Check` and :class:`Advice` say what one key allows and, for a value
that is not allowed, what is (:meth:`Constraint.problem`); :func:`message` words the error line, naming a key
with its flag (:data:`FLAGS`, :func:`key_name`). :data:`LOAD` / :data:`TRAIN` / :data:`EVAL` say when a
constraint is checked.
"""

from __future__ import annotations

import difflib
import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ConfigError

LOAD, TRAIN, EVAL = "load", "train", "eval"
ON_LOAD = frozenset({LOAD})
ON_TRAIN = frozenset({TRAIN})
ON_EVAL = frozenset({EVAL})
ON_RUN = frozenset({TRAIN, EVAL})

# The config key each flag of train.py / eval.py sets (messages about the key name the flag too).
FLAGS = {
    "output": "train.py --output",
    "train.resume": "train.py --resume",
    "train.overwrite": "train.py --overwrite",
    "eval.checkpoint": "eval.py --checkpoint",
    "model.name": "eval.py --model",
    "data.path": "eval.py --data",
    "eval.img_sizes": "eval.py --img-size",
    "eval.use_ema": "eval.py --ema",
    "eval.batch_size": "eval.py --batch-size",
    "eval.json": "eval.py --json",
    "sample.sampler": "eval.py --sampler",
    "sample.steps": "eval.py --steps",
    "sample.cfg_scale": "eval.py --cfg-scale",
    "sample.num_samples": "eval.py --num-samples",
}


def key_name(key: str, mode: str | None = None) -> str:
    """``"config key eval.batch_size (eval.py --batch-size)"``: how messages name a key, with the flag that
    sets it; in a run of ``mode`` (:data:`TRAIN`, :data:`EVAL`) only a flag of that mode's script."""
    flag = FLAGS.get(key, "")
    script = {TRAIN: "train.py ", EVAL: "eval.py "}.get(mode or "", "")
    return f"config key {key}" + (f" ({flag})" if flag and flag.startswith(script) else "")


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _show(v: Any) -> str:
    """A value as the user types it (YAML: true/false/null)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg``'s value at ``key`` (``default`` where ``cfg`` is None or lacks it)."""
    try:
        return cfg.get_path(key) if cfg is not None else default
    except ConfigError:
        return default


# -------------------------------------------------------------------------------------- constraint kinds
class Constraint:
    """What one key allows.

    Args:
        null: what null means, for a key that takes it (shown in the message; whether null is accepted at all
            is the type check's :data:`~vit3.engine.config.NULLABLE`). A null value is never checked here.
        when: the checks it belongs to: :data:`LOAD` (every load), :data:`TRAIN` / :data:`EVAL` (the start
            of a run of that mode).
        only_if: ``(cfg, mode) -> bool``: whether the constraint applies to this config at all (e.g. a key
            that one task reads only); ``None``: always.
    """

    def __init__(
        self,
        null: str = "",
        when: frozenset[str] = ON_LOAD,
        only_if: Callable[[Any, str | None], bool] | None = None,
    ) -> None:
        self.null, self.when, self.only_if = null, when, only_if

    def applies(self, cfg: Any, mode: str | None) -> bool:
        if not (LOAD in self.when or mode in self.when):
            return False
        return self.only_if is None or bool(self.only_if(cfg, mode))

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        """``None`` when ``value`` is allowed, else ``(what is allowed, why not)`` (the second may be "")."""
        raise NotImplementedError


class Range(Constraint):
    """The values a numeric key allows: ``lo``/``hi`` bounds (a number, or another key's dotted name whose
    value is the bound), each closed unless ``lo_open``/``hi_open``. A list value must hold allowed values
    only, in increasing order with ``ordered`` (a ``(min, max)`` pair), as many as one of ``length`` (empty:
    any number) and at least ``min_length``.
    """

    def __init__(
        self,
        lo: float | str | None = None,
        hi: float | str | None = None,
        lo_open: bool = False,
        hi_open: bool = False,
        ordered: bool = False,
        length: tuple[int, ...] = (),
        min_length: int = 0,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.lo, self.hi, self.lo_open, self.hi_open, self.ordered = lo, hi, lo_open, hi_open, ordered
        self.length, self.min_length = length, min_length

    def bounds(self, cfg: Any) -> tuple[float | None, float | None]:
        """The numeric bounds in ``cfg`` (a bound named by a key that ``cfg`` lacks or sets to a non-number
        is no bound)."""

        def value(bound: float | str | None) -> float | None:
            if isinstance(bound, str):
                bound = config_value(cfg, bound)
            return float(bound) if is_number(bound) else None

        return value(self.lo), value(self.hi)

    def allows(self, value: Any, cfg: Any) -> bool:
        """Whether ``value`` (a finite number, or a list of them) is allowed; a string (``nan``, ``12x``,
        which no numeric key takes, also where no type check reads the key) is not; other values are the type
        check's."""
        lo, hi = self.bounds(cfg)

        def inside(v: Any) -> bool:
            if isinstance(v, str) or (is_number(v) and not math.isfinite(v)):
                return False
            if not is_number(v):
                return True
            above = lo is None or (v > lo if self.lo_open else v >= lo)
            below = hi is None or (v < hi if self.hi_open else v <= hi)
            return above and below

        if isinstance(value, list | tuple):
            numbers = [v for v in value if is_number(v)]
            in_order = not self.ordered or all(a <= b for a, b in itertools.pairwise(numbers))
            counted = (not self.length or len(value) in self.length) and len(value) >= self.min_length
            return all(inside(v) for v in value) and in_order and counted
        return inside(value)

    def describe(self, cfg: Any) -> str:
        """``"> 0"``, ``"in [0, 1)"``, ``"<= train.base_lr (0.001)"``, ... (for messages)."""
        lo, hi = self.bounds(cfg)

        def shown(bound: float | str | None, number: float | None) -> str:
            return f"{bound} ({number:g})" if isinstance(bound, str) else f"{number:g}"

        if lo is not None and hi is not None:
            return (
                f"in {'(' if self.lo_open else '['}{shown(self.lo, lo)}, {shown(self.hi, hi)}"
                f"{')' if self.hi_open else ']'}"
            )
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {shown(self.lo, lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {shown(self.hi, hi)}"
        return "any number"

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        if self.allows(value, cfg):
            return None
        what = self.describe(cfg)
        if not isinstance(value, list | tuple) and not (is_number(value) and math.isfinite(value)):
            what = "a finite number" + ("" if what == "any number" else f" {what}")
        if isinstance(value, list | tuple):
            count = " or ".join(map(str, self.length)) + " " if self.length else ""
            some = "a non-empty list" if self.min_length and not count else "a list"
            what = f"{some} of {count}values {what}" + (", in increasing order" if self.ordered else "")
        return what, ""


class Choice(Constraint):
    """One of a few values: ``values``, or ``values(cfg)`` (e.g. the task's datasets), or the name
    ``"module:ATTRIBUTE"`` of the tuple that the code using the value defines (imported when checked; a module
    that cannot be imported, e.g. of an optional extra, leaves the value to the code that needs it)."""

    def __init__(self, values: tuple[Any, ...] | str | Callable[[Any], Sequence[Any]], **common: Any) -> None:
        super().__init__(**common)
        self.values = values

    def options(self, cfg: Any) -> tuple[Any, ...] | None:
        """The allowed values (``None``: unknown here, e.g. an optional dependency is missing)."""
        if isinstance(self.values, str):
            module, _, attr = self.values.partition(":")
            try:
                return tuple(getattr(importlib.import_module(module), attr))
            except ImportError:
                return None
        values = self.values(cfg) if callable(self.values) else self.values
        return None if values is None else tuple(values)

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        options = self.options(cfg)
        if options is None or any(value == o and type(value) is type(o) for o in options):
            return None
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
        return f"one of {', '.join(map(_show, options))}", f"did you mean {close[0]}?" if close else ""


class Check(Constraint):
    """A value to parse, look up or find on disk: ``test(value, cfg)`` returns ``None`` when it is fine,
    else why it is not; ``what`` says what is allowed."""

    def __init__(self, what: str, test: Callable[[Any, Any], str | None], **common: Any) -> None:
        super().__init__(**common)
        self.what, self.test = what, test

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        why = self.test(value, cfg)
        return None if why is None else (self.what, why)


class Advice(Constraint):
    """A value that runs but may not mean what the user expects: ``test(value, cfg)`` returns the warning
    (what the value means, and how to get the usual behaviour), or ``None``. Never an error."""

    def __init__(self, test: Callable[[Any, Any], str | None], **common: Any) -> None:
        super().__init__(**common)
        self.test = test

    def problem(self, value: Any, cfg: Any) -> tuple[str, str] | None:
        return None


POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
PROBABILITY = Range(0, 1)
PAIR = (2,)


def message(name: str, value: Any, constraint: Constraint, what: str, why: str) -> str:
    """One line of a :class:`~vit3.errors.ConfigError`: ``<name> must be <what>[ (or null: ...)], got
    <value>[: <why>]``."""
    null = f" (or null: {constraint.null})" if constraint.null else ""
    return f"{name} must be {what}{null}, got {value!r}" + (f": {why}" if why else "")
