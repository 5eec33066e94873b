"""``vitconvert eval MODEL --data DATA``: top-1, top-5, loss and throughput of any model on a split."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from ..top_k import top_k_text
from .common import (
    MODEL_HELP,
    DataDirOpt,
    DataOpt,
    DeviceOpt,
    DownloadOpt,
    JsonOpt,
    PretrainedOpt,
    SplitOpt,
    ThreadsOpt,
    WorkersOpt,
    console,
    loading_libraries,
    user_errors,
    working,
)


@user_errors
def eval_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    data: DataOpt,
    split: SplitOpt = "val",
    batch_size: int = typer.Option(64, "--batch-size", help="images per forward"),
    device: DeviceOpt = None,
    data_dir: DataDirOpt = None,
    download: DownloadOpt = False,
    workers: WorkersOpt = 0,
    pretrained: PretrainedOpt = True,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate with the model's own preprocessing (the run's, for distill run folders).

    Example: vitconvert eval runs/quickstart/mhla --data digits
    """
    with loading_libraries():
        from ..evaluate import evaluate  # lazy: start-up time (and --help's)

    with working(f"evaluating {model} on {data}"):
        metrics = evaluate(model, data, split=split, batch_size=batch_size, device=device, data_dir=data_dir,
                           download=download, workers=workers, pretrained=pretrained, threads=threads)
    if as_json:
        typer.echo(json.dumps({k: metrics[k] for k in ("top1", "top5", "loss", "n", "img_s", "classes")}))
        return
    table = Table(title=f"{model} on {data} ({split})")
    for col in ("top-1", "top-5", "loss", "images", "img/s"):
        table.add_column(col, justify="right")
    table.add_row(f"{100 * metrics['top1']:.2f}%", top_k_text(metrics["top5"], metrics["classes"]),
                  f"{metrics['loss']:.4f}", str(metrics["n"]), f"{metrics['img_s']:.0f}")
    console.print(table)
