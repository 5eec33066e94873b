"""``vitconvert convert SOURCE --to VARIANT``: softmax ViT -> linear-attention model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .common import (
    DataDirOpt,
    DownloadOpt,
    JsonOpt,
    OptionOpt,
    PretrainedOpt,
    SeedOpt,
    ThreadsOpt,
    VariantOpt,
    console,
    loading_libraries,
    parse_options,
    plural,
    remember_last_convert,
    report_table,
    user_errors,
    working,
)

if TYPE_CHECKING:
    from ..convert_job import ConvertResult


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
    layers: Optional[str] = typer.Option(None, "--layers", help="swap only these attention layers, e.g. 2-11 "
                                                                "(a hybrid; the rest keep softmax)"),
    keep_softmax: Optional[str] = typer.Option(None, "--keep-softmax", help="keep these layers softmax, e.g. 0,1; "
                                               "or auto:K, the K that lose most as linear, measured on --data"),
    data: Optional[str] = typer.Option(None, "--data", help="data to measure the layers on (--keep-softmax "
                                                            "auto:K): image folder, timm dataset name or digits"),
    signal: str = typer.Option("logit-kl", "--signal", help="how auto:K measures a layer: logit-kl (the logit KL "
                               "putting it back to softmax removes) or attn-gap (its attention output after a short "
                               "distillation)"),
    data_dir: DataDirOpt = None,
    download: DownloadOpt = False,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Load a softmax ViT, swap every attention for a linear variant, init by recipe, write a folder.

    Example: vitconvert convert deit_small --to mhla
    Example: vitconvert convert digits --to elu --keep-softmax auto:1 --data digits
    """
    with loading_libraries():
        from ..convert_job import convert_source  # lazy: start-up time (and --help's)

    result = convert_source(source, to, out, attn_init=attn_init, mlp_init=mlp_init, rest_init=rest_init, seed=seed,
                            num_classes=num_classes, pretrained=pretrained, arch=arch, img_size=img_size,
                            options=parse_options(option), layers=layers, keep_softmax=keep_softmax, data=data,
                            signal=signal, data_dir=data_dir, download=download, force=force, progress=working,
                            threads=threads)
    remember_last_convert(result.out)  # only now: a failed convert leaves the record of the last one that finished
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    print_result(result, to, signal, data)


def print_result(result: ConvertResult, to: str, signal: str, data: Optional[str]) -> None:
    """The report table, the hybrid's layers (and how they were chosen), the notes, where the folder is."""
    from ..card import hybrid_layers  # lazy: start-up time

    info = result.report.to_dict()
    surgery = result.report.surgery
    linear = len(surgery.replaced)
    layers = f"{linear} of {plural(surgery.depth, 'attention layer')} linear" if surgery.hybrid else \
        f"{plural(linear, 'attention layer')} linear"
    console.print(report_table(info, f"{result.arch} -> {to} ({layers})"))
    if result.report.surgery.hybrid:
        chosen = f" (chosen by {signal} on {data})" if result.selection else ""
        console.print(f"hybrid: {hybrid_layers(info)}{chosen}")
    for note in info["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"[green]wrote[/] {result.out}/ in {result.seconds:.1f}s")
