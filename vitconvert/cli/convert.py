"""``vitconvert convert SOURCE --to VARIANT``: softmax ViT -> linear-attention model folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..attention import VARIANTS
from ..convert import convert as convert_model
from ..errors import VitconvertError
from ..folder import check_options, save
from ..sources import load_source
from ..writer import check_output
from .common import (
    JsonOpt,
    OptionOpt,
    PretrainedOpt,
    SeedOpt,
    VariantOpt,
    console,
    parse_options,
    remember_last_convert,
    report_table,
    user_errors,
)


@user_errors
def convert(
    source: Annotated[str, typer.Argument(help="timm name, alias (deit_small), hf-hub:org/name[@rev], folder or file")],
    to: VariantOpt,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder [default: ./<timm-name>-<variant>]"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output folder"),
    attn_init: str = typer.Option("mimetic", help="matched attention params: mimetic, copy, random"),
    mlp_init: str = typer.Option("copy", help="MLPs: copy, random"),
    rest_init: str = typer.Option("copy", help="embeddings, tokens, norms, head: copy, random"),
    seed: SeedOpt = 0,
    num_classes: Optional[int] = typer.Option(None, help="re-head the model with N classes (new head is random)"),
    pretrained: PretrainedOpt = True,
    arch: Optional[str] = typer.Option(None, help="architecture of a bare weights file"),
    img_size: Optional[int] = typer.Option(None, help="build the source at this image size (timm resamples)"),
    option: OptionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Load a softmax ViT, swap every attention for a linear variant, init by recipe, write a folder.

    Example: vitconvert convert deit_small --to mhla
    """

    if to not in VARIANTS:
        raise VitconvertError(f"unknown variant {to!r}; valid: {', '.join(VARIANTS)}")
    if num_classes is not None and num_classes < 1:
        raise VitconvertError(f"--num-classes must be at least 1 (got {num_classes})")
    if img_size is not None and img_size < 1:
        raise VitconvertError(f"--img-size must be at least 1 (got {img_size})")
    if out is not None:  # refuse before the work, not after it
        check_output(out, force=force, inputs=[source])
    options = parse_options(option)
    check_options(to, options)
    kwargs = {"img_size": img_size} if img_size is not None else {}
    start = time.perf_counter()
    src = load_source(source, pretrained=pretrained, arch=arch, **kwargs)
    out = out or Path(f"{src.arch}-{to}")
    check_output(out, force=force, inputs=[source])
    student, report = convert_model(src.model, to, attn_init=attn_init, mlp_init=mlp_init, rest_init=rest_init,
                                    seed=seed, num_classes=num_classes, options=options, source=source)
    save(student, out, force=force, inputs=[source], pretrained=src.pretrained)
    elapsed = time.perf_counter() - start
    remember_last_convert(out)
    info = report.to_dict()
    if as_json:
        typer.echo(json.dumps({"out": str(out), "seconds": round(elapsed, 3), **info}))
        return
    console.print(report_table(info, f"{src.arch} -> {to} ({len(report.surgery.replaced)} attention layers)"))
    for note in info["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"[green]wrote[/] {out}/ in {elapsed:.1f}s")
