"""``vitconvert bench SOURCE --to elu,relu --img-size 224,512``: speed and memory against the softmax source."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.table import Table

from .common import (
    DeviceOpt,
    JsonOpt,
    OptionOpt,
    PlotForceOpt,
    PlotOpt,
    PretrainedOpt,
    VariantsOpt,
    console,
    make_console,
    parse_options,
    plot_output,
    user_errors,
)


def bench_table(report: dict[str, Any]) -> Table:
    """One row per (size, mode, model); speedups against the softmax row of the same size and mode."""
    backend = " in ONNX Runtime" if report.get("backend") == "onnxruntime" else ""
    precision = f"{report['amp']} autocast" if report.get("amp") else "float32"
    title = (f"{report['arch']}{backend} on {report['device']} in {precision} ({report['threads']} threads, "
             f"batch {report['batch_size']}, median of {report['repeats']}, {report['clock']} clock)")
    if report.get("keep_softmax"):
        title += f"; hybrids: softmax kept in layers {','.join(map(str, report['keep_softmax']))}"
    table = Table(title=title)
    for col in ("px", "tokens", "mode", "model", "ms/img", "img/s", "MiB", "GFLOP", "speedup", "bound"):
        table.add_column(col, justify="left" if col in ("mode", "model") else "right")
    last = None
    for row in report["results"]:
        if last is not None and (row["img_size"], row["mode"]) != last:
            table.add_section()
        last = (row["img_size"], row["mode"])
        softmax = row["model"] == "softmax"
        memory = "-" if row["peak_mem_mb"] is None else f"{row['peak_mem_mb']:.1f}"
        table.add_row(
            str(row["img_size"]), str(row["tokens"] or "?"), row["mode"], row["model"], f"{row['ms_per_img']:.1f}",
            f"{row['img_per_s']:.2f}", memory, f"{row['gflops_per_img']:.2f}",
            "" if softmax else f"{row['speedup']:.2f}×", "" if softmax else f"{row['flop_bound']:.2f}×")
    return table


@user_errors
def bench(
    source: str = typer.Argument(..., help="timm name, alias, hf-hub:org/name, timm or vitconvert folder"),
    to: VariantsOpt = None,
    img_size: Optional[str] = typer.Option(None, "--img-size", help="image sizes, comma-separated (default: the "
                                                                      "model's); the source is rebuilt at each"),
    batch_size: int = typer.Option(1, help="images per step"),
    train: bool = typer.Option(False, "--train", help="also time a training step (forward + backward)"),
    repeats: int = typer.Option(5, help="timed rounds; every model runs once per round, in turns"),
    warmup: int = typer.Option(1, help="untimed rounds first"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's)"),
    device: DeviceOpt = None,
    pretrained: PretrainedOpt = True,
    option: OptionOpt = None,
    clock: str = typer.Option("wall", help="wall, or cpu: the process's CPU time (steady on a shared machine; "
                                             "use it with --threads 1)"),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="also measure peak memory (one more step)"),
    amp: str = typer.Option("auto", "--amp", help="autocast dtype of every forward: auto (bfloat16 on CUDA, "
                                                  "none on the CPU), bfloat16, float16 or none"),
    backend: str = typer.Option("torch", "--backend", help="torch, or onnxruntime: each model exported to ONNX "
                                                           "and timed in ONNX Runtime (CPU, inference)"),
    keep_softmax: Optional[str] = typer.Option(None, "--keep-softmax", help="time hybrids: these layers stay "
                                                                            "softmax in every variant, e.g. 0,1"),
    as_json: JsonOpt = False,
    plot: PlotOpt = None,
    force: PlotForceOpt = False,
) -> None:
    """Time the softmax source and each linear variant in one process, taking turns: img/s, memory, speedups.

    Example: vitconvert bench deit_small --no-pretrained --to elu,mhla --img-size 224,512
    """
    from ..bench import benchmark, parse_sizes, parse_variants, plot_speedups, require_matplotlib  # lazy: start-up time

    variants = parse_variants(to)
    sizes = parse_sizes(img_size)
    with plot_output(plot, force, [source]) as plot:
        if plot is not None:
            require_matplotlib()  # fail before the work, not after it
        progress = make_console(stderr=True)
        report = benchmark(source, variants, sizes, batch_size=batch_size, train=train, repeats=repeats,
                           warmup=warmup, pretrained=pretrained, device=device, threads=threads,
                           options=parse_options(option), memory=memory, clock=clock, amp=amp, backend=backend,
                           keep_softmax=keep_softmax,
                           log=None if as_json else lambda msg: progress.print(f"[dim]timing {msg}[/]"))
        if plot is not None:
            plot_speedups(report, plot, force=force, inputs=[source])
    if as_json:
        import json

        typer.echo(json.dumps({**report.to_dict(), **({"plot": str(plot)} if plot else {})}))
        return
    console.print(bench_table(report.to_dict()))
    console.print("speedup = softmax ms / model ms (same size and mode); FLOP bound = softmax FLOPs / model FLOPs")
    if plot is not None:
        console.print(f"[green]wrote[/] {plot}")
