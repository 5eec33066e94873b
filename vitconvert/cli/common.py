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
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted", code=130)
        except Exception as e:  # a bug, but still no traceback for the user
            if os.environ.get("VITCONVERT_DEBUG"):
                raise
            fail(f"{type(e).__name__}: {e} (internal error; rerun with VITCONVERT_DEBUG=1 for the traceback)")

    return wrapper  # type: ignore[return-value]


def parse_options(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, values read as YAML scalars (true, 3, 0.5, cos)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise VitconvertError(f"--option expects KEY=VALUE, got {pair!r}")
        options[key.strip()] = yaml.safe_load(value)
    return options


def is_tty() -> bool:
    return sys.stdout.isatty()
