"""``vitconvert quickstart``: the whole method on the bundled digits, offline, in minutes on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import app
from .common import console, user_errors


def results_table(result: dict) -> Table:
    """Teacher, then each variant's distilled student and its scratch twin: val top-1 and training time."""
    scratch = {r["variant"]: r for r in result["scratch"]}
    table = Table(title=f"digits val ({result['teacher'].get('n', 297)} images), {result['epochs']} epochs each")
    for col, justify in (("model", "left"), ("how", "left"), ("val top-1", "right"), ("vs scratch", "right"),
                         ("time", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    teacher = result["teacher"]
    table.add_row("teacher", "softmax, bundled", f"{100 * teacher['top1']:.2f}%", "", "")
    for row in result["students"]:
        twin = scratch.get(row["variant"])
        gap = f"{100 * (row['top1'] - twin['top1']):+.2f} pt" if twin else ""
        table.add_section()
        table.add_row(row["variant"], "copied+Mimetic, distilled", f"{100 * row['top1']:.2f}%", gap,
                      f"{row['seconds']:.0f}s")
        if twin:
            table.add_row(f"{row['variant']} scratch", "random, task loss", f"{100 * twin['top1']:.2f}%", "",
                          f"{twin['seconds']:.0f}s")
    return table


@app.command()
@user_errors
def quickstart(
    variants: str = typer.Option("elu,relu,inline,mhla,ttt", "--variants", help="comma-separated variants"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="epochs per model [default: recipes/quickstart]"),
    out: Path = typer.Option(Path("runs/quickstart"), "--out", "-o", help="folder for the converted and run folders"),
    seed: int = typer.Option(0, help="seed of the init and the training"),
    scratch: bool = typer.Option(True, "--scratch/--no-scratch", help="also train each variant from scratch"),
    device: Optional[str] = typer.Option(None, help="cpu, cuda, cuda:1 [default: cuda if available]"),
    threads: int = typer.Option(1, help="CPU threads (0: torch's default); 1 is fastest for these tiny models"),
    force: bool = typer.Option(False, "--force", help="overwrite the runs of an earlier quickstart in --out"),
    as_json: bool = typer.Option(False, "--json", help="print the results as one JSON object"),
) -> None:
    """Distil the bundled digits teacher into linear-attention students and compare them with scratch."""
    from ..quickstart import Result, parse_variants, run_quickstart

    chosen = parse_variants(variants)
    log = Console(stderr=True)

    def progress(row: Result) -> None:
        time = f" in {row.seconds:.0f}s" if row.seconds else ""
        log.print(f"[green]{row.name}[/]: val top-1 {100 * row.top1:.2f}%{time}")

    result = run_quickstart(chosen, out, epochs=epochs, seed=seed, scratch=scratch, device=device, force=force,
                            threads=threads or None, progress=progress).to_dict()
    if as_json:
        typer.echo(json.dumps(result))
        return
    console.print(results_table(result))
    losers = [v for v, ok in result["beats_scratch"].items() if not ok]
    verdict = (f"[red]not above scratch: {', '.join(losers)}[/]" if losers
               else "[green]every distilled student beats its scratch twin[/]" if result["scratch"] else "")
    console.print(f"{verdict}  total {result['seconds']:.0f}s".strip())
    console.print(f"models in {out}/; try: vitconvert eval {out}/{chosen[0]} --data digits")
