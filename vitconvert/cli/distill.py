"""``vitconvert distill [STUDENT]``: train a converted student against its softmax teacher, per a recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from . import app
from .common import console, parse_pairs, user_errors


def parse_sets(pairs: Optional[list[str]]) -> dict[str, Any]:
    """``--set key=value`` pairs: recipe overrides."""
    return parse_pairs(pairs, "--set")


def default_student() -> Path:
    """The folder the last `vitconvert convert` in this directory wrote."""
    from ..errors import VitconvertError
    from .convert import LAST_CONVERT

    if LAST_CONVERT.is_file():
        path = Path(LAST_CONVERT.read_text().strip())
        if path.is_dir():
            return path
        raise VitconvertError(f"the last converted folder ({path}) is gone: name the STUDENT folder")
    raise VitconvertError("no STUDENT given and no `vitconvert convert` was run in this directory: name the "
                          "converted model folder")


@app.command()
@user_errors
def distill(
    student: Optional[Path] = typer.Argument(None, help="converted model folder (default: the last convert's)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe YAML or name in recipes/ (cifar100, ...)"),
    data: Optional[str] = typer.Option(None, "--data", help="image folder (train/, val/), torch/cifar100, "
                                                            "hfds/..., or digits"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="root of timm dataset names"),
    download: bool = typer.Option(False, "--download", help="let timm/torchvision download the dataset"),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="softmax teacher SOURCE (default: the student's "
                                                                  "recorded source)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="run folder (default: ./runs/<student>-<recipe>)"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="total epochs (all stages)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="global batch per optimizer step"),
    lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed of data order, augmentation and dropout"),
    attn_weight: Optional[float] = typer.Option(None, "--attn-weight", help="weight of attention distillation"),
    kd_weight: Optional[float] = typer.Option(None, "--kd-weight", help="weight of logit KD (0: off)"),
    attn_target: Optional[str] = typer.Option(None, "--attn-target", help="own or teacher-forced"),
    attn_loss: Optional[str] = typer.Option(None, "--attn-loss", help="mse, cosine or smooth_l1"),
    stages: Optional[str] = typer.Option(None, "--stages", help="joint, or e.g. attn:5,finetune"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="any recipe key, KEY=VALUE (repeatable)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 (default: GPU if any)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out from checkpoint-last"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing run (or resume a changed recipe)"),
    fsdp: bool = typer.Option(False, "--fsdp", help="shard the model with FSDP under torchrun (large models)"),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the student"),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="upload the run folder to org/name"),
    as_json: bool = typer.Option(False, "--json", help="print the final metrics as one JSON object"),
) -> None:
    """Distill attention from the softmax teacher and fine-tune; the run folder is itself a model folder."""
    from ..distill import DistillJob, run
    from ..recipes import load_recipe

    flags = {"data": data, "data_dir": data_dir, "epochs": epochs, "batch_size": batch_size, "lr": lr,
             "seed": seed, "attn_weight": attn_weight, "kd_weight": kd_weight, "attn_target": attn_target,
             "attn_loss": attn_loss, "stages": stages}
    overrides = {**parse_sets(set_), **{k: v for k, v in flags.items() if v is not None}}
    if download:
        overrides["download"] = True
    parsed, text = load_recipe(recipe, overrides)
    student = student or default_student()
    out = out or Path("runs") / f"{student.resolve().name}-{parsed.name}"
    result = run(DistillJob(student=str(student), recipe=parsed, out=out, recipe_text=text, teacher=teacher,
                            resume=resume, force=force, device=device, fsdp=fsdp, compile=compile_,
                            show=not as_json))
    if push_to_hub and is_main_process():
        from ..hub import push_folder

        push_folder(result.folder, push_to_hub)
    if not is_main_process():
        return
    if as_json:
        typer.echo(json.dumps({"out": str(result.folder), **result.metrics}))
        return
    m = result.metrics
    if "top1" in m:
        console.print(f"val top1 {100 * m['top1']:.2f}%  top5 {100 * m['top5']:.2f}%  (best {100 * m['best_top1']:.2f}%"
                      f" at epoch {m['best_epoch']})")
    console.print(f"[green]wrote[/] {result.folder}/ in {result.seconds:.1f}s")


def is_main_process() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
