"""``vitconvert convert SOURCE --to VARIANT``: softmax ViT -> linear-attention model folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from . import app
from .common import console, parse_options, user_errors

LAST_CONVERT = Path(".vitconvert") / "last_convert"


def report_table(report: dict[str, Any], title: str) -> Table:
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


def remember_last_convert(out: Path) -> None:
    """`distill` with no folder takes the one the last `convert` in this directory wrote."""
    try:
        LAST_CONVERT.parent.mkdir(exist_ok=True)
        LAST_CONVERT.write_text(str(out.resolve()) + "\n")
    except OSError:
        pass


@app.command()
@user_errors
def convert(
    source: str = typer.Argument(..., help="timm name, alias (deit_small), hf-hub:org/name[@rev], folder or file"),
    to: str = typer.Option(..., "--to", help="linear variant: elu, relu, inline, mhla, ttt"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="output folder [default: ./<timm-name>-<variant>]"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing output folder"),
    attn_init: str = typer.Option("mimetic", help="matched attention params: mimetic, copy, random"),
    mlp_init: str = typer.Option("copy", help="MLPs: copy, random"),
    rest_init: str = typer.Option("copy", help="embeddings, tokens, norms, head: copy, random"),
    seed: int = typer.Option(0, help="seed of every random and Mimetic init"),
    num_classes: Optional[int] = typer.Option(None, help="re-head the model with N classes (new head is random)"),
    pretrained: bool = typer.Option(True, "--pretrained/--no-pretrained", help="load pretrained weights of names"),
    arch: Optional[str] = typer.Option(None, help="architecture of a bare weights file"),
    img_size: Optional[int] = typer.Option(None, help="build the source at this image size (timm resamples)"),
    option: Optional[list[str]] = typer.Option(None, "--option", help="variant option KEY=VALUE (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Load a softmax ViT, swap every attention for a linear variant, init by recipe, write a folder."""
    from ..attention import VARIANTS
    from ..convert import convert as convert_model
    from ..errors import VitconvertError
    from ..folder import check_options, save
    from ..sources import load_source
    from ..writer import check_output

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
    if src.vitconvert is not None:
        raise VitconvertError(f"{source} is already a linear-attention vitconvert model; convert its softmax source")
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
