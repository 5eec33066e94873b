"""What every command shares: one-line errors, consoles, small parsers."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn, Optional, TypeVar

import typer
import yaml
from rich.console import Console

from ..errors import VitconvertError

console = Console()
F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` as exactly one line on stderr and exit non-zero."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn every failure of a command into one line on stderr (VITCONVERT_DEBUG=1 re-raises)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except VitconvertError as e:
            fail(summary(e, internal=False))
        except KeyboardInterrupt:
            fail("interrupted", code=130)
        except Exception as e:  # a bug, but still no traceback for the user
            if os.environ.get("VITCONVERT_DEBUG"):
                raise
            fail(f"{summary(e)} (internal error; rerun with VITCONVERT_DEBUG=1 for the traceback)")

    return wrapper  # type: ignore[return-value]


def summary(e: BaseException, internal: bool = True) -> str:
    """One line for ``e``: ``Type: message`` for internal errors (the type alone for an empty message), the
    message for a user error. An exception raised in a DataLoader worker arrives as "Caught X in DataLoader
    worker process N." plus the worker's traceback: keep the worker's own last line and where it happened."""
    text = str(e).strip()
    head, sep, trace = text.partition("\nOriginal Traceback")
    if sep and head.startswith("Caught "):
        lines = [line.strip() for line in trace.splitlines() if line.strip()]
        last = lines[-1] if lines else type(e).__name__
        if not internal:  # "vitconvert.errors.VitconvertError: message" -> the message
            last = last.split(f"{type(e).__name__}: ", 1)[-1]
        return f"{last} (in {head.split(' in ', 1)[-1].rstrip('.')})"
    if not internal:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def parse_pairs(pairs: Optional[list[str]], flag: str) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, values read as YAML (true, 3, 0.5, null, [0.5, 1.0], cosine); a malformed
    pair or value is a user error naming ``flag`` (--option, --set)."""
    values: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise VitconvertError(f"{flag} expects KEY=VALUE, got {pair!r}")
        try:
            values[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise VitconvertError(f"{flag} {key.strip()}: cannot read {value!r} as a value") from None
    return values


def parse_options(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``--option key=value`` pairs of convert and bench."""
    return parse_pairs(pairs, "--option")


def is_tty() -> bool:
    return sys.stdout.isatty()
