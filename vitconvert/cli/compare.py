"""``vitconvert compare STUDENT --data DATA``: which layers the student has not learned yet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from .common import (
    LINEAR_MODEL_HELP,
    DataDirOpt,
    DataOpt,
    DownloadOpt,
    JsonOpt,
    PlotForceOpt,
    PlotOpt,
    SplitOpt,
    TeacherPretrainedOpt,
    ThreadsOpt,
    WorkersOpt,
    console,
    loading_libraries,
    plot_output,
    plural,
    user_errors,
    working,
)


def gap_table(report: dict[str, Any], title: str) -> Table:
    """Per-layer rows of ``CompareReport.to_dict()``; the logit numbers go below the table."""
    table = Table(title=title)
    for col in ("layer", "attention", "attn MSE", "attn cos", "block cos"):
        table.add_column(col, justify="right")
    for row in report["layers"]:
        table.add_row(str(row["layer"]), row.get("attention", "linear"), f"{row['attn_mse']:.4g}",
                      f"{row['attn_cos']:.4f}", f"{row['block_cos']:.4f}")
    return table


@user_errors
def compare(
    student: Annotated[str, typer.Argument(help=LINEAR_MODEL_HELP)],
    data: DataOpt,
    teacher: Optional[str] = typer.Option(None, help="softmax teacher: a timm name or alias, digits, "
                                                     "hf-hub:org/name[@revision], a timm folder [default: the "
                                                     "student's recorded source]"),
    split: SplitOpt = "val",
    data_dir: DataDirOpt = None,
    download: DownloadOpt = False,
    batches: int = typer.Option(10, help="how many batches to compare on (a fixed random sample of images)"),
    batch_size: int = typer.Option(32, help="images per batch"),
    workers: WorkersOpt = 0,
    pretrained: TeacherPretrainedOpt = None,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    force: PlotForceOpt = False,
) -> None:
    """Run teacher and student on the same images: per-layer attention and block gaps, top-1 agreement, KL.

    Example: vitconvert compare runs/quickstart/mhla --data digits --plot gaps.png
    """
    with loading_libraries():
        from ..compare import compare_student, plot_compare, require_matplotlib  # lazy: start-up time (and --help's)

    inputs = [student, teacher, data]
    with plot_output(plot, force, inputs) as plot:
        if plot is not None:
            require_matplotlib()  # fail before the work, not after it
        with working(f"comparing {student} with its teacher on {data}"):
            result = compare_student(student, data, teacher, split=split, batches=batches, batch_size=batch_size,
                                     workers=workers, data_dir=data_dir, download=download, pretrained=pretrained,
                                     threads=threads)
        report, spec = result.report, result.teacher
        info = report.to_dict()
        if plot is not None:
            plot_compare(report, plot, title=f"{Path(student).name} vs {spec}", force=force,
                         inputs=[*inputs, spec])
    if as_json:
        typer.echo(json.dumps({**info, "teacher": spec, **({"plot": str(plot)} if plot else {})}))
        return
    console.print(gap_table(info, f"{student} vs {spec}"))
    console.print(f"{plural(report.images, 'image')} of {data} ({split})")
    if report.top1_agreement is None:
        console.print("[yellow]note:[/] teacher and student heads differ: no top-1 agreement or logit KL")
    else:
        console.print(f"top-1 agreement {report.top1_agreement:.2%}   logit KL(teacher‖student) {report.logit_kl:.4g}")
    if plot is not None:
        console.print(f"[green]wrote[/] {plot}")
