"""What every command shares: its options (one definition each), one-line errors, consoles, KEY=VALUE parsing,
and the folder the last ``convert`` in this directory wrote."""

from __future__ import annotations

import errno
import functools
import os
import re
import select
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional, TypeVar

import typer
import yaml
from rich.console import Console
from rich.table import Table

from ..errors import PARAM, BadValue, Stopped, VitconvertError, plural  # noqa: F401  (plural: for cli/)
from ..writer import check_file, output_lock


def stdout_closed() -> bool:
    """Whether the reader of stdout has gone (a pipe's write end with no reader polls as an error), so a broken
    pipe is the user's `| head`, not a worker's or a socket's."""
    if not hasattr(select, "poll"):
        return True
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def make_console(stderr: bool = False) -> Console:
    """A terminal's own width; a pipe or a log file no width at all, so tables and lines keep every column and
    digit (rich otherwise assumes 80 columns and cuts numbers to "2812…")."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else UNLIMITED)


UNLIMITED = 100_000
console = make_console()
F = TypeVar("F", bound=Callable[..., Any])
# The variants vitconvert ships, for --help (which must not import torch to list them from the registry: as
# COMMANDS holds each command's summary; tests/cli/test_lazy_commands.py checks it against attention.VARIANTS)
SHIPPED_VARIANTS = ("elu", "relu", "inline", "mhla", "ttt")
VARIANT_NAMES = ", ".join(SHIPPED_VARIANTS)

# -- options shared by several commands: one definition each (as huggingface_hub's CLI does with TokenOpt) -------
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 [default: a GPU if any]")]
DATA_HELP = ("image folder (train/, val/ with class subfolders), a timm dataset name (torch/cifar100, hfds/...), "
             "or digits")
DataOpt = Annotated[str, typer.Option("--data", help=DATA_HELP)]
MODEL_HELP = ("a vitconvert model or run folder (PATH or local-dir:PATH), hf-hub:org/name[@revision], or a softmax "
              "model: a timm name or alias, digits, a timm folder")  # what vitconvert.load takes (eval, export)
LINEAR_MODEL_HELP = "a vitconvert model or run folder: a path, local-dir:PATH or hf-hub:org/name[@revision]"
RecipeDataOpt = Annotated[Optional[str], typer.Option("--data", help=DATA_HELP + " [default: the recipe's]")]
SplitOpt = Annotated[str, typer.Option("--split", help="which split of DATA (a folder name for image folders)")]
DataDirOpt = Annotated[Optional[str], typer.Option("--data-dir", help="root of timm dataset names")]
DownloadOpt = Annotated[bool, typer.Option("--download", help="let timm/torchvision download the dataset")]
WorkersOpt = Annotated[int, typer.Option("--workers", help="DataLoader worker processes")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="also write the figure as a PNG here (a new .png, "
                                                                  "or one vitconvert wrote, with --force)")]
PlotForceOpt = Annotated[bool, typer.Option("--force", help="replace an existing --plot PNG that vitconvert wrote")]
VariantOpt = Annotated[str, typer.Option("--to", help=f"linear variant: {VARIANT_NAMES}")]
VariantsOpt = Annotated[Optional[str], typer.Option("--to", help=f"variants, comma-separated ({VARIANT_NAMES}) "
                                                                  "[default: all, or the folder's]")]
OptionOpt = Annotated[Optional[list[str]], typer.Option("--option", help="variant option KEY=VALUE (repeatable; "
                                                                         "`vitconvert list` shows them)")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="any recipe key, SECTION.KEY=VALUE or KEY=VALUE "
                                                                    "(repeatable)")]
TeacherPretrainedOpt = Annotated[Optional[bool], typer.Option(
    "--pretrained/--no-pretrained", show_default=False,
    help="a --teacher other than the student's source: with its pretrained weights, or randomly initialised "
         "[default: as the student's source was built]")]
PretrainedOpt = Annotated[bool, typer.Option("--pretrained/--no-pretrained",
                                             help="load the pretrained weights of timm names")]
SeedOpt = Annotated[int, typer.Option("--seed", help="seed of every random draw")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="torch CPU threads [default: 1 for a model "
                                                                     "under 10M parameters, else torch's]")]


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


# Library parameters whose flag is spelled otherwise: a dict of ``options`` is given as repeated --option pairs;
# export's ``fmt`` (``format`` is Python's builtin) is --format.
FLAG_NAMES = {"options": "option", "fmt": "format"}


def flag_of(name: str) -> str:
    """The flag that sets the library parameter ``name`` (``img_size`` -> ``--img-size``)."""
    return "--" + FLAG_NAMES.get(name, name).replace("_", "-")


def _as_flag(match: re.Match) -> str:
    recipe, name, value = match.groups()
    if recipe:
        return f"--set {name}={value}"
    if value in (None, "True"):
        return flag_of(name)
    return f"--no-{flag_of(name)[2:]}" if value == "False" else f"{flag_of(name)} {value}"


def for_cli(text: str) -> str:
    """A library message with its parameter mentions (``errors.param``, ``errors.setting``) as the flags that set
    them (``--arch NAME``, ``--no-pretrained``, ``--set clip_grad=1.0``): only the command line knows flags."""
    return PARAM.sub(_as_flag, text)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` as exactly one line on stderr and exit non-zero."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn every failure of a command into one line on stderr (VITCONVERT_DEBUG=1 re-raises)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return with_notes(fn, *args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Stopped as e:  # the user asked for it: not an error; say where the work is and how to go on
            typer.echo(" ".join(for_cli(format(e)).split()), err=True)
            raise typer.Exit(e.exit_code) from None
        except BadValue as e:  # a library error about a value: name the flag that gave it
            fail(f"{flag_of(e.name)}: {summary(e, internal=False)}")
        except VitconvertError as e:
            fail(summary(e, internal=False))
        except KeyboardInterrupt:
            fail("interrupted", code=130)
        except OSError as e:  # the machine, not the code: a full disk, a read-only or forbidden place
            if isinstance(e, BrokenPipeError) and stdout_closed():
                raise  # `vitconvert list | head -1`: the CLI's entry ends the command quietly
            if e.errno not in WRITE_ERRORS:
                if os.environ.get("VITCONVERT_DEBUG"):
                    raise
                fail(f"{summary(e)} (internal error; rerun with VITCONVERT_DEBUG=1 for the traceback)")
            fail(f"cannot write {e.filename or 'a file'}: {e.strerror}")
        except Exception as e:  # a bug, but still no traceback for the user
            if os.environ.get("VITCONVERT_DEBUG"):
                raise
            fail(f"{summary(e)} (internal error; rerun with VITCONVERT_DEBUG=1 for the traceback)")

    return wrapper  # type: ignore[return-value]


def with_notes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` with vitconvert's own warnings (an old folder layout, ...) as one ``note:`` line each on stderr,
    not Python's two-line warning with a source line."""
    def note(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if category.__module__.split(".")[0] == "vitconvert":
            typer.echo(f"note: {' '.join(str(message).split())}", err=True)
        else:
            shown(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        shown = warnings.showwarning
        warnings.showwarning = note
        return fn(*args, **kwargs)


def summary(e: BaseException, internal: bool = True) -> str:
    """One line for ``e``: ``Type: message`` for internal errors (the type alone for an empty message), the
    message for a user error. An exception raised in a DataLoader worker arrives as "Caught X in DataLoader
    worker process N." plus the worker's traceback: keep the worker's own last line and where it happened."""
    text = for_cli(format(e)).strip()
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


HEARTBEAT_AFTER_S, HEARTBEAT_EVERY_S = 10.0, 30.0
HEARTBEAT = "{what}... ({seconds}s)"  # still_working's line: what runs, and for how many whole seconds so far
HEARTBEAT_LINE = re.compile("^" + re.escape(HEARTBEAT).replace(r"\{what\}", "(?P<what>.+)")
                            .replace(r"\{seconds\}", r"(?P<seconds>\d+)") + "$")  # (tests tell it from the error)


@contextmanager
def still_working(what: str) -> Iterator[None]:
    """Long work is never silent: a line on stderr once ``what`` has run HEARTBEAT_AFTER_S seconds, then one
    every HEARTBEAT_EVERY_S (a terminal and a log alike); quick work prints nothing."""
    done, start = threading.Event(), time.monotonic()

    def beat() -> None:
        wait = HEARTBEAT_AFTER_S
        while not done.wait(wait):
            typer.echo(HEARTBEAT.format(what=what, seconds=round(time.monotonic() - start)), err=True)
            wait = HEARTBEAT_EVERY_S

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def working(what: str, heartbeat: bool = True) -> Iterator[None]:
    """Say at once what the command is doing (building a model, converting): on a terminal a status line on stderr
    that rich clears when the work ends; in a pipe or a log no spinner, only still_working's heartbeat if it runs
    long (``heartbeat``), so that the output holds results and an error stays one line."""
    err = make_console(stderr=True)
    if err.is_terminal:
        with err.status(f"{what}…"):
            yield
    else:
        with still_working(what) if heartbeat else nullcontext():
            yield


def loading_libraries() -> AbstractContextManager[None]:
    """Around a command's imports of torch and timm (seconds; --help skips them): said on a terminal."""
    return working("loading torch and timm", heartbeat=False)


@contextmanager
def plot_output(plot: Optional[Path], force: bool, inputs: Iterable[Any] = ()) -> Iterator[Optional[Path]]:
    """``--plot``, checked and locked before the work (a folder, another suffix, a file vitconvert did not write,
    an input, a read-only place: refused in a second, not after the benchmark); the path to write, ``~``
    expanded."""
    if plot is None:
        with nullcontext():
            yield None
        return
    path = check_file(plot, force=force, inputs=[i for i in inputs if i], name="plot", suffix=".png")
    with output_lock(path):
        yield path


def parse_pairs(pairs: Optional[list[str]], flag: str) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, values read as YAML (true, 3, 0.5, null, [0.5, 1.0], cosine); a malformed
    pair or value is a user error naming ``flag`` (--option, --set)."""
    values: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise VitconvertError(f"{flag} expects KEY=VALUE, got {pair!r}")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            raise VitconvertError(f"{flag} {key.strip()}: cannot read {value!r} as a value") from None
        values[key.strip()] = number_or_text(parsed)
    return values


def number_or_text(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; a user typing it means the number."""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if value.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity") else value
    return value


def parse_options(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``--option key=value`` pairs of convert and bench."""
    return parse_pairs(pairs, "--option")


def parse_sets(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``--set key=value`` pairs: recipe overrides."""
    return parse_pairs(pairs, "--set")


def recipe_overrides(pairs: Optional[list[str]], flags: dict[str, Any]) -> dict[str, Any]:
    """One dict of recipe overrides, from ``--set`` pairs (``schedule.epochs=3`` or the flat ``epochs=3``) and the
    command's own flags (None: not given), for the recipe's one path (``recipes.build_recipe``). One rule: a field
    is given once; ``--set epochs=abc`` beside ``--epochs 3`` is refused, not dropped unread."""
    from ..recipes import field_path  # lazy: start-up time

    sets = parse_sets(pairs)
    given = {k: v for k, v in flags.items() if v is not None}
    paths = {field_path(k): k for k in sets}
    for key in given:
        if field_path(key) in paths:
            pair = next(p for p in pairs or [] if p.partition("=")[0].strip() == paths[field_path(key)])
            raise VitconvertError(f"--set {pair} and {flag_of(key)} both set the recipe's {key}: give it once")
    return {**sets, **given}


# -- the CLI's one piece of state: the folder the last `convert` in this directory wrote --------------------------
LAST_CONVERT = Path(".vitconvert") / "last_convert"


def remember_last_convert(out: Path) -> None:
    """`distill` with no folder takes the one the last `convert` in this directory wrote."""
    try:
        LAST_CONVERT.parent.mkdir(exist_ok=True)
        LAST_CONVERT.write_text(str(out.resolve()) + "\n")
    except OSError:
        pass


def last_converted() -> Path:
    """The folder the last `vitconvert convert` in this directory wrote (distill's first line names it)."""
    if not LAST_CONVERT.is_file():
        raise VitconvertError("no STUDENT given and no `vitconvert convert` finished in this directory: name the "
                              "converted model folder")
    try:
        text = LAST_CONVERT.read_text(encoding="utf-8").strip()
    except (UnicodeDecodeError, OSError):
        text = ""
    if not text or "\0" in text or "\n" in text:
        raise VitconvertError(f"{LAST_CONVERT} holds no folder path (damaged; the next convert here rewrites it): "
                              "name the STUDENT folder")
    path = Path(text)
    if path.is_dir():
        return path
    raise VitconvertError(f"the last converted folder ({path}) is gone: name the STUDENT folder")


def report_table(report: dict[str, Any], title: str) -> Table:
    """The conversion report as a terminal table (convert and info print it)."""
    table = Table(title=title)
    for col, justify in (("group", "left"), ("init", "left"), ("tensors", "right"), ("parameters", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in report.get("groups", []):
        table.add_row(row["group"], row["action"], str(row["tensors"]), f"{row['params']:,}")
    totals = report.get("totals", {})
    table.add_section()
    table.add_row("total", ", ".join(f"{k} {v:,}" for k, v in totals.items()), "",
                  f"{sum(totals.values()):,}")
    return table
