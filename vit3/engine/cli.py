"""The command-line boundary of ``train.py``, ``eval.py`` and ``export.py``.

:func:`run_cli` parses the arguments (``key.sub=value`` overrides may come before, between or after the
options) and runs the script's body. A user error (:class:`~vit3.errors.UserError`: a bad config value, an
unknown class, a truncated or mismatched checkpoint, a corrupt image; or a missing file) ends the script with
one line ``error: <message>`` on stderr and exit code :data:`USER_ERROR_EXIT`, wherever it was raised, even
inside a DataLoader worker. ``--debug`` (or ``VIT3_DEBUG=1``) re-raises it with its traceback instead. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence

from ..errors import UserError

USER_ERROR_EXIT = 2  # the exit code of argparse's own usage errors
DEBUG_ENV = "VIT3_DEBUG"
OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")  # key.sub=value
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, FileNotFoundError)

__all__ = ["DEBUG_ENV", "USER_ERRORS", "USER_ERROR_EXIT", "add_debug_flag", "run_cli", "user_message"]


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Adds ``--debug`` (show the traceback of a user error)."""
    parser.add_argument(
        "--debug", action="store_true", help=f"show the traceback of an error (also: {DEBUG_ENV}=1)"
    )


def _debug(args: argparse.Namespace | None) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no")


def user_message(exc: BaseException) -> str:
    """The message of a user error; for one re-raised from a DataLoader worker (whose message embeds the
    worker's traceback) the original message only."""
    text = str(exc)
    if (
        "Original Traceback" in text
    ):  # torch.utils.data._utils.ExceptionWrapper: "<type>: <message>" at the end
        for name in (f"{type(exc).__module__}.{type(exc).__qualname__}", type(exc).__qualname__):
            at = text.rfind(f"\n{name}: ")
            if at >= 0:
                return text[at + len(name) + 3 :].strip()
    return text


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
) -> int:
    """Parses ``argv`` and returns ``body(args)``, or :data:`USER_ERROR_EXIT` after printing a user error.

    Args:
        parser: the script's parser (``--debug`` is added unless it has one).
        body: the script's work; returns the exit code.
        argv: arguments (default: ``sys.argv[1:]``).
        intermixed: positional arguments (overrides) may be interleaved with options
            (``argparse.parse_intermixed_args``; not available for parsers with sub-commands).
    """
    if "--debug" not in parser._option_string_actions:  # a parser with sub-commands adds it to their parent
        add_debug_flag(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if intermixed:
        args = parser.parse_intermixed_args(_overrides_last(parser, argv))
    else:
        args = parser.parse_args(argv)
    before, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        return body(args)
    except USER_ERRORS as exc:
        if _debug(args):
            raise
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return USER_ERROR_EXIT
    finally:
        warnings.formatwarning = before
