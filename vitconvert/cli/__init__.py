"""The ``vitconvert`` command line: one file per command, each thin over the library."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="vitconvert",
    help="Turn a pretrained softmax ViT into a fast linear-attention ViT: convert, distill, eval, push.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module registers its command(s) on `app` when imported; one line per command file.
COMMAND_MODULES = ["convert", "info", "push", "compare", "quickstart", "distill", "eval", "bench"]

for _name in COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}")


def main() -> None:
    app()
