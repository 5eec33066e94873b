"""``vitconvert export MODEL --format onnx``: ONNX or .pt2 next to the model folder, checked against PyTorch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .common import (
    MODEL_HELP,
    JsonOpt,
    PretrainedOpt,
    ThreadsOpt,
    console,
    loading_libraries,
    user_errors,
    working,
)


@user_errors
def export(
    model: str = typer.Argument(..., help=MODEL_HELP),
    format: str = typer.Option("onnx", "--format", "-f", help="onnx (ONNX Runtime checks it) or pt2 "
                                                              "(torch.export's ExportedProgram)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="output file [default: MODEL.onnx / MODEL.pt2, "
                                                                 "beside a local folder, else here]"),
    img_size: Optional[int] = typer.Option(None, "--img-size", help="export at this image size (position "
                                                                    "embeddings resampled) [default: the model's]"),
    batch_size: int = typer.Option(2, "--batch-size", help="batch the export is checked at (and the only one it "
                                                           "takes with --fixed-batch)"),
    dynamic_batch: bool = typer.Option(True, "--dynamic-batch/--fixed-batch", help="any batch size at run time "
                                                                                  "(checked at two), or one"),
    opset: Optional[int] = typer.Option(None, "--opset", help="ONNX opset, 18 to 23 [default: 18]"),
    force: bool = typer.Option(False, "--force", help="replace an existing output file"),
    pretrained: PretrainedOpt = True,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Export a model to ONNX or .pt2 and check its logits against PyTorch on real images.

    Example: vitconvert export ./deit_small_patch16_224-mhla --format onnx --dynamic-batch
    """
    with loading_libraries():
        from ..export import export as export_model  # lazy: start-up time (and --help's)

    with working(f"exporting {model} to {format} and checking it"):
        result = export_model(model, format, out, img_size=img_size, batch_size=batch_size,
                              dynamic_batch=dynamic_batch, opset=opset, force=force, pretrained=pretrained,
                              threads=threads)
    if as_json:
        typer.echo(json.dumps(result.to_dict()))
        return
    batches = " and ".join(map(str, result.checked_batches))
    console.print(f"wrote {result.path} ({result.format}, {result.img_size} px, "
                  f"{'any batch' if result.dynamic_batch else f'batch {result.batch_size}'}) in "
                  f"{result.seconds:.1f}s; logits vs PyTorch on real images (batch {batches}): relative error "
                  f"{result.rel_error:.1e}")
