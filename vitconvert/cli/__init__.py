"""The ``vitconvert`` command line: one file per command, each thin over the library."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from ..version import __version__
from . import bench, compare, convert, distill, export, info, push, quickstart
from . import eval as evaluate

try:  # typer >= 0.24 vendors click as typer._click; its exceptions are the ones raised
    from typer._click import exceptions as click
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click  # type: ignore[no-redef]


class OneLineErrors(TyperGroup):
    """Parser errors (a non-numeric --epochs, an unknown flag) as one ``error:`` line, like every other error,
    instead of click's usage box; Ctrl-C while parsing is ``error: interrupted`` (exit 130)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
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
    """--help shows a flag as a flag (``--force``), not as an option taking a value (``--force <bool>``)."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


app = typer.Typer(
    cls=OneLineErrors,
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


# The commands, registered here in the order `vitconvert --help` lists them (a new command: one line).
app.command(cls=Command)(convert.convert)
app.command(cls=Command)(distill.distill)
app.command("eval", cls=Command)(evaluate.eval_cmd)
app.command(cls=Command)(compare.compare)
app.command(cls=Command)(bench.bench)
app.command(cls=Command)(export.export)
app.command(cls=Command)(push.push)
app.command(cls=Command)(quickstart.quickstart)
app.command("list", cls=Command)(info.list_cmd)
app.command(cls=Command)(info.info)


def main() -> None:
    app()
