"""``vitconvert upgrade FOLDER``: rewrite a folder of an older vitconvert layout in place, as ``save`` writes today."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import VitconvertError
from .common import JsonOpt, console, loading_libraries, user_errors


@user_errors
def upgrade(folder: Path = typer.Argument(..., help="a vitconvert model or run folder written by an older version"),
            as_json: JsonOpt = False) -> None:
    """Rewrite an older model folder in place (atomically, same weights) so that timm and transformers load it
    as the linear model, or refuse it without vitconvert, instead of building softmax attention.

    Example: vitconvert upgrade ./deit_small_patch16_224-elu
    """
    with loading_libraries():
        from ..folder import upgrade_folder  # lazy: start-up time (and --help's)

    if folder.is_file():
        raise VitconvertError(f"{folder} is a file, not a model folder: give the folder that holds config.json")
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    old = upgrade_folder(folder)
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), "upgraded": old is not None, "from_format": old}))
    elif old is None:
        console.print(f"{folder} is already in today's layout: nothing to do")
    else:
        console.print(f"upgraded {folder} (format {old}) to today's layout: timm and transformers load it after "
                      "`import vitconvert`")
