"""``vitconvert eval MODEL --data DATA``: top-1, top-5, loss and throughput of any model on a split."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from . import app
from .common import console, user_errors


@app.command("eval")
@user_errors
def eval_cmd(
    model: str = typer.Argument(..., help="model or run folder, hf-hub:org/name, or any softmax SOURCE"),
    data: str = typer.Option(..., "--data", help="image folder (val/ inside), torch/cifar100, hfds/..., digits"),
    split: str = typer.Option("val", "--split", help="split to evaluate (a folder name for image folders)"),
    batch_size: int = typer.Option(64, "--batch-size", help="images per forward"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 (default: GPU if any)"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="root of timm dataset names"),
    download: bool = typer.Option(False, "--download", help="let timm/torchvision download the dataset"),
    workers: int = typer.Option(0, "--workers", help="DataLoader worker processes"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: top1, top5 (fractions), loss, n"),
) -> None:
    """Evaluate with the model's own preprocessing (the run's, for distill run folders)."""
    from ..errors import VitconvertError
    from ..evaluate import evaluate

    if workers < 0:
        raise VitconvertError(f"--workers must not be negative (got {workers}; 0 loads in this process)")
    metrics = evaluate(model, data, split=split, batch_size=batch_size, device=device, data_dir=data_dir,
                       download=download, workers=workers)
    if as_json:
        typer.echo(json.dumps({k: metrics[k] for k in ("top1", "top5", "loss", "n", "img_s")}))
        return
    table = Table(title=f"{model} on {data} ({split})")
    for col in ("top-1", "top-5", "loss", "images", "img/s"):
        table.add_column(col, justify="right")
    table.add_row(f"{100 * metrics['top1']:.2f}%", f"{100 * metrics['top5']:.2f}%", f"{metrics['loss']:.4f}",
                  str(metrics["n"]), f"{metrics['img_s']:.0f}")
    console.print(table)
