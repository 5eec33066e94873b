"""The ``vitconvert`` command line: one file per command, each thin over the library.

Commands are loaded lazily, as huggingface_hub's ``hf`` does (``_LAZY_COMMANDS``): ``vitconvert --help`` and
``--version`` read the table below and import no command module (and so neither torch nor timm); a command's
module is imported when that command runs or shows its own ``--help``.
"""

from __future__ import annotations

import sys


def _interrupted(kind: type[BaseException], value: BaseException, tb: object) -> None:
    """Ctrl-C while Python starts the command (before typer runs it) is one line, not a traceback."""
    if issubclass(kind, KeyboardInterrupt):
        print("error: interrupted", file=sys.stderr)
    else:
        sys.__excepthook__(kind, value, tb)  # type: ignore[arg-type]


sys.excepthook = _interrupted

import errno  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from typer.core import TyperCommand, TyperGroup  # noqa: E402

from ..dependencies import check as check_dependencies  # noqa: E402
from ..errors import VitconvertError  # noqa: E402
from ..hub_io import check_endpoint  # noqa: E402
from ..version import __version__  # noqa: E402

try:  # typer >= 0.26 vendors click as typer._click; its exceptions are the ones raised
    from typer._click import exceptions as click
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click  # type: ignore[no-redef]


# The commands in the order `vitconvert --help` lists them: name -> (module in vitconvert/cli/, function, summary).
# The summary is the first paragraph of the function's docstring (tests/cli/test_lazy_commands.py checks that);
# a new command is one line here.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "convert": ("convert", "convert", "Load a softmax ViT, swap every attention for a linear variant, init by "
                                      "recipe, write a folder."),
    "distill": ("distill", "distill", "Distill attention from the softmax teacher and fine-tune; the run folder is "
                                      "itself a model folder."),
    "eval": ("eval", "eval_cmd", "Evaluate with the model's own preprocessing (the run's, for distill run folders)."),
    "compare": ("compare", "compare", "Run teacher and student on the same images: per-layer attention and block "
                                      "gaps, top-1 agreement, KL."),
    "bench": ("bench", "bench", "Time the softmax source and each linear variant in one process, taking turns: "
                                "img/s, memory, speedups."),
    "export": ("export", "export", "Export a model to ONNX or .pt2 and check its logits against PyTorch on real "
                                   "images."),
    "push": ("push", "push", "Validate the folder, refresh its model card and upload it to the Hub in one commit."),
    "quickstart": ("quickstart", "quickstart", "Distil the bundled digits teacher into linear-attention students and "
                                               "compare them with scratch."),
    "list": ("info", "list_cmd", "Short model aliases, linear-attention variants and training recipes."),
    "info": ("info", "info", "What a converted model is and what was copied."),
    "upgrade": ("upgrade", "upgrade", "Rewrite an older model folder in place (same weights) so that timm and "
                                      "transformers load it as the linear model, or refuse it without vitconvert, "
                                      "instead of building softmax attention; a folder timm's save_for_hf wrote from a "
                                      "vitconvert model becomes a full vitconvert folder (transformers, push, info)."),
}


class LazyCommand(TyperCommand):
    """A command as the group's help lists it (name and summary); its module is imported when it is run."""

    def __init__(self, name: str, module: str, function: str, summary: str) -> None:
        super().__init__(name, help=summary)
        self.module, self.function = module, function

    def load(self) -> TyperCommand:
        """The real command: its module imported, its function turned into a command as Typer registers it. The
        installed dependencies are checked first: a too-old timm or typer is one line naming it, not a traceback
        from inside the import (:mod:`..dependencies`)."""
        try:
            check_dependencies()
            check_endpoint()  # huggingface_hub reads HF_ENDPOINT at import: a bad port breaks every command
        except VitconvertError as e:
            raise click.ClickException(str(e)) from None
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        module = importlib.import_module(f"{__name__}.{self.module}")
        single.command(self.name, cls=Command)(getattr(module, self.function))
        return typer.main.get_command(single)

    def make_context(self, info_name: Optional[str], args: list[str], parent: Any = None, **extra: Any) -> Any:
        """Click's entry for running a command: the real command is built (and imported) only here."""
        return self.load().make_context(info_name, args, parent=parent, **extra)


@contextmanager
def said_interrupted() -> Iterator[None]:
    """Ctrl-C inside the block is ``error: interrupted`` and exit 130 (typer's own main says nothing)."""
    try:
        yield
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130) from None


# What a command exits with when the reader of its output has gone (`vitconvert list | head -1`): 128 + SIGPIPE, as
# a program the signal ends (git log | head) reports it, so `set -o pipefail` scripts tell it from an error.
CLOSED_PIPE_STATUS = 141


def _raise_broken_pipe(console: Console) -> None:
    console.quiet = True
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


@contextmanager
def ended_quietly_on_closed_pipe() -> Iterator[None]:
    """A reader that closed its end of stdout ends the command quietly, with the closed-pipe status. Python's own
    pattern: stdout pointed at devnull, so the interpreter's last flush has nowhere to fail. Rich's consoles (ours
    and typer's help) would exit 1 themselves, which reads as an error: inside the block they raise the pipe's
    error on to here."""
    rich_handler, Console.on_broken_pipe = Console.on_broken_pipe, _raise_broken_pipe  # type: ignore[method-assign]
    try:
        yield
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        sys.exit(CLOSED_PIPE_STATUS)
    finally:
        Console.on_broken_pipe = rich_handler  # type: ignore[method-assign]


def shown_as_flags(params: list[Any]) -> list[Any]:
    """Flags with no metavar, so --help shows ``--force``, not ``--force <bool>``."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Commands(TyperGroup):
    """The commands of COMMANDS, each loaded when run. Parser errors (a non-numeric --epochs, an unknown flag) are one
    ``error:`` line, like every other error, instead of click's usage box; Ctrl-C while parsing (or while a command's
    module imports torch) is ``error: interrupted`` (exit 130)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, (module, function, summary) in COMMANDS.items():
            self.add_command(LazyCommand(name, module, function, summary))

    def get_params(self, ctx: Any) -> list[Any]:
        """The group's options with boolean flags shown as flags in ``--help``."""
        return shown_as_flags(super().get_params(ctx))

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        """Parse the command line (help printed into a closed pipe ends quietly); Ctrl-C during it is one line, not
        a traceback."""
        with ended_quietly_on_closed_pipe(), said_interrupted():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        """Run the chosen command (output into a closed pipe ends it quietly: click's own handler would exit 1, as
        an error does); Ctrl-C during it is one line, not a traceback."""
        with ended_quietly_on_closed_pipe(), said_interrupted():
            return super().invoke(ctx)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """Click's main without its standalone mode, so errors and help go through vitconvert's one-line funnel."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else e.format_message())
            sys.exit(e.exit_code)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "vitconvert"
            typer.echo(f"error: {' '.join(e.format_message().split())} (see `{command} --help`)", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
            sys.exit(e.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            typer.echo("error: interrupted", err=True)
            sys.exit(130)
        sys.exit(result if isinstance(result, int) else 0)


class Command(TyperCommand):
    """--help shows a flag as a flag (``--force``), not as an option taking a value (``--force <bool>``), and help
    texts as written: typer reads them as rich markup, where "[default: ./NAME]" or "org/name[@rev]" would vanish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = escape(self.help) if self.help else self.help
        for param in self.params:
            if getattr(param, "help", None):
                param.help = escape(param.help)

    def get_params(self, ctx: Any) -> list[Any]:
        """The command's options with boolean flags shown as flags in ``--help``."""
        return shown_as_flags(super().get_params(ctx))


app = typer.Typer(
    cls=Commands,
    name="vitconvert",
    help="Turn a pretrained softmax ViT into a fast linear-attention ViT: convert, distill, eval, push.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"vitconvert {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print vitconvert's version and exit")) -> None:
    """Turn a pretrained softmax ViT into a fast linear-attention ViT: convert, distill, eval, push."""


def main() -> None:
    """The ``vitconvert`` console script (and ``python -m vitconvert``). What is still buffered is written here, where
    a reader that closed the pipe ends the command quietly, not at the interpreter's exit (exit 120, a message)."""
    with ended_quietly_on_closed_pipe():
        try:
            app()
        finally:
            sys.stdout.flush()
