"""``vitconvert upgrade FOLDER``: rewrite a folder of an older vitconvert layout (or one timm's own savers wrote
from a vitconvert model) in place, as ``save`` writes today."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import VitconvertError
from .common import JsonOpt, console, loading_libraries, user_errors


def folder_of(spec: str) -> Path:
    """The local folder a FOLDER argument names: a path or ``local-dir:PATH``; a Hub repo or anything else is one
    line saying what upgrade takes."""
    if spec.startswith("hf-hub:"):
        repo = spec.removeprefix("hf-hub:")
        raise VitconvertError(f"{spec} is a Hub repo: upgrade rewrites a folder of your own in place; download it "
                              f"(`hf download {repo} --local-dir DIR`), upgrade DIR, then `vitconvert push DIR "
                              f"--repo {repo.split('@')[0]}`")
    folder = Path(spec.removeprefix("local-dir:")).expanduser()
    if folder.is_file():
        raise VitconvertError(f"{folder} is a file, not a model folder: give the folder that holds config.json")
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    return folder


@user_errors
def upgrade(folder: str = typer.Argument(..., help="a vitconvert model or run folder (a path or local-dir:PATH) "
                                                   "written by an older version, or saved by timm from one"),
            as_json: JsonOpt = False) -> None:
    """Rewrite an older model folder in place (same weights) so that timm and transformers load it as the linear
    model, or refuse it without vitconvert, instead of building softmax attention; a folder timm's save_for_hf
    wrote from a vitconvert model becomes a full vitconvert folder (transformers, push, info).

    Example: vitconvert upgrade ./deit_small_patch16_224-elu
    """
    with loading_libraries():
        from ..folder_upgrade import upgrade_folder  # lazy: start-up time (and --help's)

    path = folder_of(folder)
    old = upgrade_folder(path)
    was = old or {}
    if as_json:
        typer.echo(json.dumps({"folder": str(path), "upgraded": old is not None,
                               "from_format": was.get("format_version"), "saved_by": was.get("saved_by")}))
    elif old is None:
        console.print(f"{path} is already in today's layout: nothing to do")
    else:
        what = f"format {was['format_version']}" if "format_version" in was else f"saved by {was.get('saved_by')}"
        pickle = (f"; its {was['weights']} written as model.safetensors (the pickle kept: load reads "
                  "model.safetensors first, push leaves it out)") if was.get("weights") else ""
        console.print(f"upgraded {path} ({what}) to today's layout: timm and transformers load it after "
                      f"`import vitconvert`{pickle}")
