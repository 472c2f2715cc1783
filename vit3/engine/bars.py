"""Progress on rank 0: a tqdm bar on a terminal, plain log lines anywhere else.

A bar redraws its line with carriage returns, which a log file (a cluster job's, ``> run.log``, ``| tee``)
keeps as one line of thousands of characters an epoch. Written to anything but a terminal, the engines' same
calls print a line each time they set the bar's figures (every ``train.log_every`` steps) instead.
"""

from __future__ import annotations

import math
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import IO, Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

_OPEN: weakref.WeakSet[tqdm] = weakref.WeakSet()  # the bars made here and not yet closed
LINE_FORMAT = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"  # a log line's start, in tqdm's fields


class LogLines:
    """The calls the engines make on a tqdm bar, as log lines: each :meth:`set_postfix` prints
    ``<desc> <n>/<total> [<elapsed><<remaining>] <key> <value> ...`` (the time left at the rate since the
    bar began, as tqdm writes it); nothing else prints."""

    def __init__(self, total: int, initial: int, desc: str, file: IO[str]) -> None:
        self.total, self.n, self.desc, self.file = total, initial, desc, file
        self.initial, self.start = initial, time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix(self, **figures: Any) -> None:
        seconds = time.perf_counter() - self.start
        meter = tqdm.format_meter(self.n, self.total, seconds, prefix=self.desc, initial=self.initial,
                                  bar_format=LINE_FORMAT)  # fmt: skip
        values = "".join(f" {key} {value}" for key, value in figures.items())
        print(meter + values, file=self.file, flush=True)

    def close(self) -> None:
        """Nothing to end: every line was whole."""


Bar = tqdm | LogLines  # what :func:`progress_bar` returns


def figures_due(step: int, every: int) -> bool:
    """Whether a bar's figures (off a terminal, a log line) are due after ``step`` (counted from 1): every
    ``every`` steps (``train.log_every``), never where ``every`` is 0."""
    return every > 0 and step % every == 0


def on_terminal(file: IO[str]) -> bool:
    """Whether ``file`` is a terminal, where a bar can redraw its line."""
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(
    total: int, desc: str, enabled: bool, initial: int = 0, leave: bool = False, file: IO[str] | None = None
) -> Bar:
    """The progress of ``total`` steps, written to ``file`` (stdout): a tqdm bar on a terminal, else
    :class:`LogLines`; a disabled bar (writes nothing) where ``enabled`` is false (a rank other than 0,
    ``train.progress=false``)."""
    file = sys.stdout if file is None else file
    if enabled and not on_terminal(file):
        return LogLines(total, initial, desc, file)
    bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, leave=leave, file=file,
               dynamic_ncols=True)  # fmt: skip
    _OPEN.add(bar)
    return bar


def progress_iter(items: Sequence[T], desc: str, enabled: bool, lines: int = 10) -> Iterator[T]:
    """``items`` with their progress on stdout where ``enabled``: a bar on a terminal, else a
    :class:`LogLines` line after each tenth of them (``lines``: how many lines in all) and after the last."""
    if not enabled:
        return iter(items)
    if not on_terminal(sys.stdout):
        return _logged(items, desc, max(1, math.ceil(len(items) / lines)))
    bar = tqdm(items, desc=desc, leave=False, dynamic_ncols=True, file=sys.stdout)
    _OPEN.add(bar)
    return iter(bar)


def _logged(items: Sequence[T], desc: str, every: int) -> Iterator[T]:
    """``items``, a line written after every ``every``-th one is done and after the last."""
    lines = LogLines(len(items), 0, desc, sys.stdout)
    for i, item in enumerate(items, 1):
        yield item
        lines.update()
        if i % every == 0 or i == len(items):
            lines.set_postfix()


def close_bars() -> None:
    """Ends the bars an exception left open (a bar's line is cleared, or finished with ``leave``), so that
    the line written next starts a line of its own."""
    for bar in list(_OPEN):
        bar.close()
    sys.stdout.flush()
