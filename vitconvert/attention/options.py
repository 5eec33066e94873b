"""A variant's options, each declared once: its name, default, meaning, how a given value is read and which
values are refused.

A variant class lists its :class:`Option` s in ``declared_options``; from that one list come the constructor's
keyword options and their checks (``BadValue(option_name, ...)``), ``default_options``, the ``options`` block of
config.json (the values as read), the check of a folder's or a caller's options (:func:`read_options`: the
command line's ``--option KEY=VALUE`` and config.json go through it), and the options `vitconvert list` shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..errors import BadValue


class Refused(ValueError):
    """Raised by a reader for a value it cannot take; the message says what it takes (``takes a finite number``)."""


@dataclass(frozen=True)
class Option:
    """One option of a variant. ``read`` turns a given value (Python, JSON or YAML from the command line) into the
    stored one or raises :class:`Refused`; ``check`` says why a read value is refused, or None."""

    name: str
    default: Any
    doc: str
    read: Callable[[Any], Any]
    check: Optional[Callable[[Any], Optional[str]]] = None
    applies: Optional[tuple[str, Any]] = None  # (option, value): does something only when that option has that value

    def value(self, given: Any, variant: str) -> Any:
        """``given`` as stored, or ``BadValue(name, ...)`` in one line."""
        try:
            value = self.read(given)
            problem = self.check(value) if self.check is not None else None
        except Refused as e:
            problem = str(e)
        if problem:
            raise BadValue(self.name, f"{variant}'s {self.name} {problem}, got {given!r} (default {self.default!r})")
        return value


# -- readers: a given value -> the stored value --------------------------------------------------------------------
def flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Refused("takes true or false")
    return value


def number(value: Any) -> float:
    """A finite float (ints too; not a bool, which JSON and YAML keep apart from numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused("takes a finite number")
    return float(value)


def number_or_auto(value: Any) -> Optional[float]:
    """A finite float, or None: the variant derives the value from the layer's shape."""
    return None if value is None else number(value)


def integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused("takes an integer")
    return value


def choice(*values: str) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        if value not in values:
            raise Refused(f"takes one of {', '.join(values)}")
        return value

    return read


def count_or_pair(value: Any) -> Any:
    """None, a positive int, or a pair of them (kept a list: JSON has no tuples)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_positive_int(v) for v in value):
        return list(value)
    if _positive_int(value):
        return value
    raise Refused("takes a positive integer, a pair of them or null")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# -- checks: a read value -> why it is refused ------------------------------------------------------------------------
def positive(value: float) -> Optional[str]:
    return None if value > 0 else "must be positive"


# -- a declaration as a whole ---------------------------------------------------------------------------------------
def with_defaults(declared: Iterable[Option], defaults: Mapping[str, Any], variant: str) -> tuple[Option, ...]:
    """The declaration with other defaults (each read and checked as a given value is)."""
    return tuple(replace(o, default=o.value(defaults[o.name], variant)) if o.name in defaults else o
                 for o in declared)


def read_options(declared: Iterable[Option], given: Any, variant: str, param: str = "option") -> dict[str, Any]:
    """Every declared option's value: ``given``'s (read and checked), else its default. Anything refused is
    ``BadValue(param, ...)``, one line naming the option (``param`` "option": the command line's ``--option``,
    as convert's own option errors say)."""
    table = {o.name: o for o in declared}
    if not isinstance(given, Mapping):
        raise BadValue(param, f"the {variant} options must be a mapping of names to values, got {given!r}")
    unknown = [k for k in given if k not in table]
    if unknown:
        raise BadValue(param, f"unknown option {unknown[0]!r} for {variant}; valid: {', '.join(table) or 'none'}")
    try:
        return {name: o.value(given[name], variant) if name in given else o.default for name, o in table.items()}
    except BadValue as e:
        raise BadValue(param, f"{e}") from None


def in_effect(declared: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the options that do nothing under the others' values (plain ELU's ``init_scale``): what
    ``list``, ``info``, a card and a module's repr show. config.json keeps them all, so folders load as before."""
    applies = {o.name: o.applies for o in declared if o.applies is not None}
    return {k: v for k, v in values.items() if k not in applies or values.get(applies[k][0]) == applies[k][1]}


def describe(declared: Iterable[Option]) -> str:
    """The options as a docstring section (help() of a variant class)."""
    lines = [f"- ``{o.name}`` (default {o.default!r}): {o.doc}" for o in declared]
    return "Options:\n\n" + "\n".join(lines) if lines else ""
