"""One exception type for everything a user can get wrong; the CLI prints it as one line."""

import re
from typing import Any

PARAM = re.compile(r"\u27e6(set:)?([a-z_]+)(?:=([^\u27e7]*))?\u27e7")


def param(name: str, value: Any = None) -> str:
    """Mentions a parameter inside an error message, as the reader knows it: ``pretrained=False`` for a library
    caller, ``--no-pretrained`` on the command line (``cli.common.for_cli``). The library never spells a flag."""
    return f"\u27e6{name}\u27e7" if value is None else f"\u27e6{name}={value}\u27e7"


def setting(key: str, value: Any) -> str:
    """Mentions a recipe setting: ``clip_grad=1.0 in the recipe`` for a library caller, ``--set clip_grad=1.0`` on
    the command line."""
    return f"\u27e6set:{key}={value}\u27e7"


def _as_argument(match: re.Match) -> str:
    recipe, name, value = match.groups()
    if recipe:
        return f"{name}={value} in the recipe"
    return name if value is None else f"{name}={value}"


class VitconvertError(Exception):
    """A problem with the user's input (names, paths, files, options), explained in one sentence.

    Parameter mentions (``param``) read as arguments in ``str(e)``; ``f"{e}"`` keeps them marked, so a message
    that wraps another (``f"cannot load the teacher: {e}"``) still shows flags on the command line."""

    def __str__(self) -> str:
        return PARAM.sub(_as_argument, super().__str__())

    def __format__(self, spec: str) -> str:
        return format(super().__str__(), spec)


def plural(n: int, word: str, many: str = "") -> str:
    """``1 epoch``, ``2 epochs``, ``0 threads``, ``3 classes`` (``many``: a plural that is not word + s): counts in
    messages and tables."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (cut at ``limit``), or its type name when empty."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(e).__name__


def load_reason(e: BaseException, limit: int = 240) -> str:
    """Why ``load_state_dict`` refused: its first line is only "Error(s) in loading state_dict for X:", the
    reason (missing, unexpected keys, size mismatches) follows; this is the reason, on one line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    reason = " ".join(lines[1:] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines)
    reason = reason or type(e).__name__
    return reason if len(reason) <= limit else reason[:limit - 1] + "…"


def unreadable_file(path: Any, e: BaseException, kind: str = "safetensors", limit: int = 160) -> VitconvertError:
    """The one line for a weights file that does not parse (a download cut short, a disk that filled up): which
    file, that it is corrupt or truncated, and the reader's own first line of why."""
    return VitconvertError(f"cannot read {path}: corrupt or truncated {kind} ({first_line(e, limit)})")


DISK_FULL = ("No space left on device", "StorageFull", "Disk quota exceeded")


def disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT, also as a library reports it in another exception type (safetensors' SafetensorError)."""
    import errno

    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(t in str(e) for t in DISK_FULL)


class BadValue(VitconvertError):
    """A bad value of one named parameter (``img_size``): the library speaks of the value, the CLI names the flag
    that gave it (``--img-size``), so library errors never assume the command line."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


class Stopped(VitconvertError):
    """The user stopped the command (Ctrl-C, SIGTERM) and it ended cleanly: not an error. The CLI prints the
    message (where the work was saved, how to continue) and exits 128 + the signal number, as a shell does."""

    def __init__(self, message: str, signal_name: str = "SIGINT"):
        super().__init__(message)
        import signal

        self.signal_name = signal_name
        self.exit_code = 128 + int(getattr(signal.Signals, signal_name, signal.SIGINT))
