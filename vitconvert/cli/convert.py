"""``vitconvert convert SOURCE --to VARIANT``: softmax ViT -> linear-attention model folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from ..attention import VARIANTS
from ..card import hybrid_layers
from ..convert import convert as convert_model
from ..errors import BadValue, VitconvertError
from ..folder import check_options, save
from ..hybrid import choose_softmax_layers
from ..selection import auto_count
from ..sources import load_source
from ..writer import check_output
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
    cpu_threads,
    forget_last_convert,
    parse_options,
    remember_last_convert,
    report_table,
    still_working,
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
    from ..threads import torch_threads  # lazy: start-up time


    if to not in VARIANTS:
        raise VitconvertError(f"unknown variant {to!r}; valid: {', '.join(VARIANTS)}")
    if num_classes is not None and num_classes < 1:
        raise VitconvertError(f"--num-classes must be at least 1 (got {num_classes})")
    if img_size is not None and img_size < 1:
        raise VitconvertError(f"--img-size must be at least 1 (got {img_size})")
    if data is None and auto_count(keep_softmax) is not None:
        raise BadValue("data", "needed by --keep-softmax auto:K: the layers are measured on a few batches of it")
    if data is not None and auto_count(keep_softmax) is None:
        raise BadValue("data", "is read only by --keep-softmax auto:K (the layers are measured on it); drop it, "
                               "or add --keep-softmax auto:K")
    if out is not None:  # refuse before the work, not after it
        check_output(out, force=force, inputs=[source])
    forget_last_convert()
    options = parse_options(option)
    check_options(to, options)
    kwargs = {"img_size": img_size} if img_size is not None else {}
    with torch_threads(cpu_threads(threads, source)):
        start = time.perf_counter()
        with torch.random.fork_rng(devices=[]), still_working(f"loading {source}"):
            torch.manual_seed(seed)  # a random-init source (--no-pretrained) is rebuilt from this seed as the teacher
            src = load_source(source, pretrained=pretrained, arch=arch, **kwargs)
        out = out or Path(f"{src.arch}-{to}")
        check_output(out, force=force, inputs=[source])
        meta: dict = {"source_seed": seed} if not src.pretrained else {}  # loading.load_teacher rebuilds it
        if img_size is not None:
            meta["source_img_size"] = img_size
        count = auto_count(keep_softmax)
        if count is not None:
            with still_working(f"measuring which {count} layer(s) to keep softmax on {data}"):
                choice = choose_softmax_layers(src.model, to, count, data, signal=signal, options=options, seed=seed,
                                               data_dir=data_dir, download=download)
            keep_softmax, meta["selection"] = ",".join(map(str, choice.keep)), {**choice.to_dict(), "data": data}
        with still_working(f"converting to {to} ({attn_init} attention init)"):
            student, report = convert_model(src.model, to, attn_init=attn_init, mlp_init=mlp_init, rest_init=rest_init,
                                            seed=seed, num_classes=num_classes, options=options, source=source,
                                            layers=layers, keep_softmax=keep_softmax or None)
        if not report.surgery.layers:
            raise BadValue("keep_softmax", "keeps every layer softmax: that is the source model itself; keep fewer")
        with still_working(f"writing {out}"):
            save(student, out, force=force, inputs=[source], pretrained=src.pretrained, **meta)
    elapsed = time.perf_counter() - start
    remember_last_convert(out)
    info = report.to_dict()
    if as_json:
        typer.echo(json.dumps({"out": str(out), "seconds": round(elapsed, 3), **info}))
        return
    console.print(report_table(info, f"{src.arch} -> {to} ({len(report.surgery.replaced)} attention layers)"))
    if report.surgery.hybrid:
        chosen = f" (chosen by {signal} on {data})" if "selection" in meta else ""
        console.print(f"hybrid: {hybrid_layers(info)}{chosen}")
    for note in info["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"[green]wrote[/] {out}/ in {elapsed:.1f}s")
