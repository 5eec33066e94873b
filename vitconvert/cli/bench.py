"""``vitconvert bench SOURCE --to elu,relu --img-size 224,512``: speed and memory against the softmax source.

The command reads its flags into one ``BenchConfig`` and makes one library call, ``vitconvert.bench.benchmark``;
what only a command line needs lives here: the comma-separated lists, the table and the ``--plot`` figure.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import typer
from rich.table import Table

from ..errors import BadValue
from ..writer import PNG_METADATA, atomic_file
from .common import (
    MODEL_HELP,
    DeviceOpt,
    JsonOpt,
    OptionOpt,
    PlotForceOpt,
    PlotOpt,
    PretrainedOpt,
    VariantsOpt,
    console,
    loading_libraries,
    make_console,
    parse_options,
    plot_output,
    plural,
    user_errors,
    working,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from ..bench import BenchReport, BenchRow


def parse_variants(text: Optional[str]) -> Optional[list[str]]:
    """``--to elu,relu`` -> ['elu', 'relu'] (each a known variant, once); None stays None (the default set)."""
    from ..attention import variant_names  # lazy: start-up time (and --help's)

    return None if text is None else variant_names(text, "to")


def parse_sizes(text: Optional[str]) -> Optional[list[int]]:
    """``--img-size 224,512`` -> [224, 512]; every entry a positive integer."""
    if text is None:
        return None
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise BadValue("img_size", f"expects positive integers separated by commas, got {text!r}")
        sizes.append(int(part))
    return list(dict.fromkeys(sizes))


def unreliable(contention: Optional[dict[str, Any]]) -> Optional[str]:
    """The report's doubt about its own times, as one sentence (None when the run looked clean)."""
    from ..contention import Contention  # lazy: start-up time

    if not contention or contention.get("reliable", True):
        return None
    return Contention(contention.get("others_cpu"), dict(contention.get("speedup_spread") or {}),
                      str(contention.get("clock", "wall"))).warning()


def bench_table(report: dict[str, Any]) -> Table:
    """One row per (size, mode, model); speedups against the softmax row of the same size and mode."""
    backend = " in ONNX Runtime" if report.get("backend") == "onnxruntime" else ""
    precision = f"{report['amp']} autocast" if report.get("amp") else "float32"
    title = (f"{report['arch']}{backend} on {report['device']} in {precision} ({plural(report['threads'], 'thread')}, "
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
    source: str = typer.Argument(..., help=MODEL_HELP + " (a vitconvert folder: its variant against its source "
                                "architecture)"),
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
    with loading_libraries():
        from ..bench import benchmark  # lazy: start-up time (and --help's)
        from ..bench_config import BenchConfig  # lazy: start-up time
        from ..compare import require_matplotlib  # lazy: start-up time
        from ..selection import auto_count  # lazy: start-up time

    if auto_count(keep_softmax) is not None:
        raise BadValue("keep_softmax", "auto:K picks the layers from data, which bench does not read: give the layers "
                                       "to keep (e.g. --keep-softmax 0,1); `vitconvert convert --keep-softmax auto:K "
                                       "--data DATA` shows the ones it picks")
    config = BenchConfig(source, parse_variants(to), parse_sizes(img_size), batch_size=batch_size, train=train,
                         repeats=repeats, warmup=warmup, pretrained=pretrained, device=device, threads=threads,
                         options=parse_options(option), memory=memory, clock=clock, amp=amp, backend=backend,
                         keep_softmax=keep_softmax)
    with plot_output(plot, force, [source]) as plot:
        if plot is not None:
            require_matplotlib()  # fail before the work, not after it
        progress = make_console(stderr=True)
        with working(f"timing {source}") if as_json else nullcontext():  # else each step has a line
            report = benchmark(config, log=None if as_json else lambda msg: progress.print(f"[dim]timing {msg}[/]"))
        if plot is not None:
            plot_speedups(report, plot, force=force, inputs=[source])
    doubt = unreliable(report.contention)
    if doubt:
        typer.echo(f"warning: {doubt}", err=True)
    if as_json:
        import json

        typer.echo(json.dumps({**report.to_dict(), **({"plot": str(plot)} if plot else {})}))
        return
    console.print(bench_table(report.to_dict()))
    console.print("speedup = softmax ms / model ms (same size and mode); FLOP bound = softmax FLOPs / model FLOPs")
    if plot is not None:
        console.print(f"[green]wrote[/] {plot}")


# -- the --plot figure --------------------------------------------------------------------------------------
def plot_speedups(report: BenchReport, path: Union[str, Path], force: bool = False,
                  inputs: Iterable[Union[str, Path]] = ()) -> Path:
    """PNG of speedup over softmax against tokens (log scale): solid measured, dashed the FLOP bound; written
    by writer.atomic_file's rules (a new .png, or one vitconvert wrote with ``force``; never an input)."""
    from ..compare import require_matplotlib  # lazy: start-up time

    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe in servers and threads

    fig = Figure(figsize=(7, 4.5), constrained_layout=True)
    ax = fig.subplots()
    _plot_curves(ax, report.rows)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ticks = sorted({r.tokens for r in report.rows if r.tokens})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens")
    ax.set_ylabel("speedup over softmax (×)")
    ax.set_title(f"{report.arch} on {report.device} ({plural(report.threads, 'thread')}, {report.clock} clock)",
                 fontsize=10)
    ax.legend(loc="best", fontsize=8)
    with atomic_file(path, force=force, inputs=inputs, name="plot", suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, metadata=PNG_METADATA)
    return Path(path).expanduser()


def _plot_curves(ax: Axes, rows: list[BenchRow]) -> None:
    """One colour per variant: its measured speedup per mode (inference solid, training dotted) and, for the
    first mode, its FLOP bound dashed."""
    from ..bench import MODES, SOFTMAX  # lazy: start-up time

    modes = sorted({r.mode for r in rows}, key=MODES.index)
    for i, name in enumerate(dict.fromkeys(r.model for r in rows if r.model != SOFTMAX)):
        for mode in modes:
            curve = sorted((r for r in rows if r.model == name and r.mode == mode and r.tokens), key=lambda r: r.tokens)
            if curve:
                _plot_curve(ax, curve, f"C{i}", with_bound=mode == modes[0], first=i == 0)


def _plot_curve(ax: Axes, curve: list[BenchRow], colour: str, with_bound: bool, first: bool) -> None:
    tokens = [r.tokens for r in curve]
    name, mode = curve[0].model, curve[0].mode
    ax.plot(tokens, [r.speedup for r in curve], "-" if mode == "infer" else ":", marker="o", color=colour,
            label=f"{name} ({mode})")
    if with_bound:
        ax.plot(tokens, [r.flop_bound for r in curve], "--", color=colour, alpha=0.4,
                label="FLOP bound" if first else None)
