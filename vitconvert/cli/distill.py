"""``vitconvert distill [STUDENT]``: train a converted student against its softmax teacher, per a recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import Stopped
from ..top_k import top_k_text
from .common import (
    DataDirOpt,
    DeviceOpt,
    DownloadOpt,
    JsonOpt,
    RecipeDataOpt,
    SetOpt,
    TeacherPretrainedOpt,
    ThreadsOpt,
    console,
    last_converted,
    loading_libraries,
    recipe_overrides,
    user_errors,
)


@user_errors
def distill(
    student: Optional[Path] = typer.Argument(None, help="converted model folder (default: the last convert's; "
                                                        "resuming: the run's own)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="recipe YAML or name in recipes/ (cifar100, ...)"),
    data: RecipeDataOpt = None,
    data_dir: DataDirOpt = None,
    download: DownloadOpt = False,
    teacher: Optional[str] = typer.Option(None, "--teacher", help="softmax teacher SOURCE (default: the student's "
                                                                  "recorded source)"),
    pretrained: TeacherPretrainedOpt = None,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="run folder (default: ./runs/<student>-<recipe>)"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="total epochs (all stages)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="global batch per optimizer step"),
    lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate"),
    seed: Optional[int] = typer.Option(None, "--seed", help="seed of data order, augmentation and dropout"),
    attn_weight: Optional[float] = typer.Option(None, "--attn-weight", help="weight of attention distillation"),
    kd_weight: Optional[float] = typer.Option(None, "--kd-weight", help="weight of logit KD (0: off)"),
    attn_target: Optional[str] = typer.Option(None, "--attn-target", help="own or teacher-forced"),
    attn_loss: Optional[str] = typer.Option(None, "--attn-loss",
                                            help="mse, cosine, smooth_l1 or weight_ce (elu, relu)"),
    stages: Optional[str] = typer.Option(None, "--stages",
                                         help="joint, or e.g. attn:5,finetune (epochs) or attn:300steps,finetune"),
    set_: SetOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out from checkpoint-last"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing run (or resume a changed recipe)"),
    fsdp: bool = typer.Option(False, "--fsdp", help="shard the model with FSDP under torchrun (large models)"),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the student"),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", help="upload the run folder to org/name"),
    as_json: JsonOpt = False,
) -> None:
    """Distill attention from the softmax teacher and fine-tune; the run folder is itself a model folder.

    Example: vitconvert distill ./deit_small_patch16_224-mhla --recipe cifar100 --data torch/cifar100 --data-dir ~/data
    """
    with loading_libraries():
        from ..distill import TrainingStopped, distill, resume_defaults  # lazy: start-up time (and --help's)
        from ..distill.checkpoint import read_checkpoint  # lazy: start-up time
        from ..distributed import is_main_process  # lazy: start-up time

    flags = {"data": data, "data_dir": data_dir, "epochs": epochs, "batch_size": batch_size, "lr": lr,
             "seed": seed, "attn_weight": attn_weight, "kd_weight": kd_weight, "attn_target": attn_target,
             "attn_loss": attn_loss, "stages": stages, "download": download or None}
    overrides = recipe_overrides(set_, flags)
    main_process = is_main_process()  # torchrun: rank 0 prints and pushes
    if push_to_hub and main_process:
        from ..hub import check_push_ready  # lazy: start-up time

        check_push_ready(push_to_hub)  # a missing token is said now, not after the training
    resumed = resume_defaults(out)[1] if resume and out is not None else None  # resuming: the run's own student
    if resume and out is not None and not (student or resumed):
        read_checkpoint(out).verify()  # a missing or damaged checkpoint says so, not "no STUDENT given"
    student = student or resumed or last_converted()
    try:  # the library sets the threads (--threads, else its rule for a small student)
        result = distill(student, out, recipe, overrides, threads=threads, teacher=teacher, pretrained=pretrained,
                         resume=resume, force=force, device=device, fsdp=fsdp, compile=compile_, show=not as_json)
    except TrainingStopped as e:
        raise Stopped(f"{e} (`vitconvert distill --resume --out {e.run}`)", e.signal_name) from None
    if push_to_hub and main_process:
        from ..hub import push_folder  # lazy: start-up time

        push_folder(result.folder, push_to_hub)
    if not main_process:
        return
    if as_json:
        typer.echo(json.dumps({"out": str(result.folder), **result.metrics}))
        return
    m = result.metrics
    if "top1" in m:
        console.print(f"val top1 {100 * m['top1']:.2f}%  top5 {top_k_text(m['top5'], m['classes'])}  (best "
                      f"{100 * m['best_top1']:.2f}% at epoch {m['best_epoch']})")
    console.print(f"[green]wrote[/] {result.folder}/ in {result.seconds:.1f}s")
