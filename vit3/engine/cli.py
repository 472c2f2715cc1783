"""The command-line boundary of ``train.py``, ``eval.py`` and ``export.py``.

:func:`run_cli` parses the arguments (``key.sub=value`` overrides anywhere) and runs the script's body. A user
error (:class:`~vit3.errors.UserError`) ends the script with one line ``error: <message>`` and exit code
:data:`USER_ERROR_EXIT`, wherever it was raised (``--debug`` / ``VIT3_DEBUG=1``: its traceback); any other
exception is a bug and keeps its traceback. Ctrl-C ends it with one line naming the last checkpoint
(:data:`INTERRUPTED_EXIT`), and so does SIGTERM (:data:`TERMINATED_EXIT`). Under torchrun, rank 0 reports.
Details: ``docs/design/engine.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import OUTPUT_ERRNOS, ConfigError, Terminated, UserError, describe_os_error, raise_terminated
from .bars import close_bars
from .config import parse_override

USER_ERROR_EXIT = 2  # the exit code of argparse's own usage errors
INTERRUPTED_EXIT = 130  # 128 + SIGINT, a shell's code for a command ended by Ctrl-C
TERMINATED_EXIT = 143  # 128 + SIGTERM
DEBUG_ENV = "VIT3_DEBUG"
OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")  # key.sub=value
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)
# A process of rank > 0 (torchrun) that meets a user error waits this long before it reports it: the same
# mistake (same command, same data) stops rank 0 too, which reports it, and the launcher then ends every
# process; a mistake only this rank meets (e.g. a corrupt image in its shard) is still reported, naming the
# rank.
RANK_REPORT_DELAY_S = 10.0

__all__ = [
    "DEBUG_ENV",
    "INTERRUPTED_EXIT",
    "RANK_REPORT_DELAY_S",
    "TERMINATED_EXIT",
    "USER_ERRORS",
    "USER_ERROR_EXIT",
    "ArgumentParser",
    "add_debug_flag",
    "check_flag_overrides",
    "flag_override",
    "interrupted_message",
    "is_user_error",
    "run_cli",
    "user_message",
]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors (an unknown flag, a missing value, a bad number) are one
    ``error:`` line, like every other user error of the scripts (exit code 2, as argparse's own)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USER_ERROR_EXIT, f"error: {message} (see {self.prog} --help)\n")


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Adds ``--debug`` (show the traceback of a user error)."""
    parser.add_argument(
        "--debug", action="store_true", help=f"show the traceback of an error (also: {DEBUG_ENV}=1)"
    )


def _debug(args: argparse.Namespace | None) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no")


def is_user_error(exc: BaseException) -> bool:
    """A mistake in the user's input: a :class:`~vit3.errors.UserError`, a missing file, or an output the
    system refused (an ``OSError`` of :data:`~vit3.errors.OUTPUT_ERRNOS`)."""
    return isinstance(exc, USER_ERRORS) or (isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS)


def _rank() -> int:
    """This process's rank in a torchrun launch (0 without one)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return 0
    return int(os.environ.get("RANK", "0") or 0)


def user_message(exc: BaseException) -> str:
    """The message of a user error; for one re-raised from a DataLoader worker (whose message embeds the
    worker's traceback) the original message only."""
    if isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.errno in OUTPUT_ERRNOS:
        return describe_os_error(exc)
    text = str(exc)
    if (
        "Original Traceback" in text
    ):  # torch.utils.data._utils.ExceptionWrapper: "<type>: <message>" at the end
        for name in (f"{type(exc).__module__}.{type(exc).__qualname__}", type(exc).__qualname__):
            at = text.rfind(f"\n{name}: ")
            if at >= 0:
                return text[at + len(name) + 3 :].strip()
    return text


def interrupted_message(resume: str = "train.py --resume {path}", terminated: bool = False) -> str:
    """What an interrupted script says: the last checkpoint it wrote and how to continue from it (``resume``,
    with ``{path}`` standing for that checkpoint); ``terminated``: by SIGTERM, not Ctrl-C."""
    from .checkpoint import last_saved  # torch, which the scripts' bodies import anyway

    what = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
    path = last_saved()
    if path is None:
        return f"{what} before this run wrote a checkpoint"
    return f"{what}; the last checkpoint written is {path} ({resume.format(path=path)} continues it)"


def _overrides_last(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Moves the ``key.sub=value`` tokens behind ``--`` so that no option (e.g. ``--img-size 224 256``, which
    takes several values) swallows them; a token that is the value of a one-value option stays in place."""
    if "--" in argv:
        return argv
    rest, overrides = [], []
    for i, token in enumerate(argv):
        action = parser._option_string_actions.get(argv[i - 1]) if i else None
        is_value = action is not None and action.nargs in (None, 1) and action.const is None
        (overrides if OVERRIDE.match(token) and not is_value else rest).append(token)
    return [*rest, "--", *overrides] if overrides else rest


def flag_override(key: str, value: Any) -> str:
    """``key=value`` for a command-line flag's value, as the config reads an override (YAML): a string
    quoted, so that it is taken as written (a path with ``#``, a date-like folder name); ``true`` /
    ``false``; numbers and lists as they print."""
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={json.dumps(value) if isinstance(value, str) else value}"


def check_flag_overrides(overrides: Sequence[str], flags: Mapping[str, tuple[str, Any]]) -> None:
    """Refuses a ``key=value`` override that gives a flag's config key another value than the flag.

    Args:
        overrides: the command line's ``key.sub=value`` tokens.
        flags: config key -> (the flag that sets it, the flag's value; ``None``: not given).

    Raises:
        ConfigError: one line naming the flag and the override that disagree.
    """

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, str) and isinstance(b, str):
            return os.path.normpath(a) == os.path.normpath(b) if a and b else a == b
        return a == b

    for token in overrides:
        key, value = parse_override(token)
        flag, given = flags.get(key, ("", None))
        if given is not None and not same(parse_override(f"{key}={given}")[1], value):
            shown = flag if given is True else f"{flag} {given}"
            raise ConfigError(f"{shown} and the override {token} disagree (both set {key}): give it once")


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """``warning: <message>`` for user warnings (vit3's); Python's own format for the other categories."""
    if category is UserWarning:
        return f"warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_PYTHON_FORMAT = warnings.formatwarning


def run_cli(
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
    intermixed: bool = True,
    resume: str = "train.py --resume {path}",
) -> int:
    """Parses ``argv`` and returns ``body(args)``, or :data:`USER_ERROR_EXIT` after printing a user error.

    Args:
        parser: the script's parser (``--debug`` is added unless it has one).
        body: the script's work; returns the exit code.
        argv: arguments (default: ``sys.argv[1:]``).
        intermixed: positional arguments (overrides) may be interleaved with options
            (``argparse.parse_intermixed_args``; not available for parsers with sub-commands).
        resume: how an interrupted run continues, for its last line (``{path}``: its last checkpoint).
    """
    if "--debug" not in parser._option_string_actions:  # a parser with sub-commands adds it to their parent
        add_debug_flag(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if intermixed:
            args = parser.parse_intermixed_args(_overrides_last(parser, argv))
        else:
            args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed: the script's exit code
        return exc.code if isinstance(exc.code, int) else USER_ERROR_EXIT
    before, warnings.formatwarning = warnings.formatwarning, _format_warning
    sigterm = _take_sigterm()
    try:
        return body(args)
    except KeyboardInterrupt as exc:
        if _debug(args):
            raise
        terminated = isinstance(exc, Terminated)
        if not _rank():  # Ctrl-C reaches every process of a torchrun launch: rank 0 says it once
            close_bars()
            print(f"error: {interrupted_message(resume, terminated)}", file=sys.stderr)
        return TERMINATED_EXIT if terminated else INTERRUPTED_EXIT
    except Exception as exc:
        if not is_user_error(exc) or _debug(args):
            raise
        message, rank = user_message(exc), _rank()
        if rank:  # rank 0 reports a mistake every rank meets; see RANK_REPORT_DELAY_S
            time.sleep(RANK_REPORT_DELAY_S)
            message = f"(rank {rank}) {message}"
        close_bars()
        print(f"error: {message}", file=sys.stderr)
        return USER_ERROR_EXIT
    finally:
        warnings.formatwarning = before
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def _take_sigterm() -> Any:
    """Has SIGTERM raise :class:`~vit3.errors.Terminated` (ended as Ctrl-C ends a run: its last checkpoint
    named, its folder's lock released) where it has its default action, in the main thread; returns the
    handler to put back, or ``None`` where nothing changed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, raise_terminated)
