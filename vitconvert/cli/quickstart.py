"""``vitconvert quickstart``: the whole method on the bundled digits, offline, in minutes on a CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from .common import (
    SHIPPED_VARIANTS,
    DeviceOpt,
    JsonOpt,
    SeedOpt,
    console,
    loading_libraries,
    make_console,
    plural,
    user_errors,
)

if TYPE_CHECKING:  # the quickstart package imports distill: only when the command runs
    from ..quickstart import Update


def recipe_epochs() -> str:
    """The quickstart recipe's epochs, for --help: read from its YAML, as --help imports no torch."""
    recipe = Path(__file__).parents[1] / "recipe_files" / "quickstart.yaml"
    try:
        return str(yaml.safe_load(recipe.read_text())["schedule"]["epochs"])
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return "the recipe's"


def results_table(result: dict) -> Table:
    """Teacher, then each variant's distilled student and its scratch twin: val top-1 and training time."""
    scratch = {r["variant"]: r for r in result["scratch"]}
    images, epochs = result["teacher"].get("n", 297), plural(result["epochs"], "epoch")
    table = Table(title=f"digits val ({images} images), {epochs} each")
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


REDRAW_S = 0.5  # a running training's step count redraws the table at most this often (a redraw costs ~5 ms)


class LiveTable:
    """One live table of every training (state, epoch, steps, val top-1) on a terminal; elsewhere a line as each
    one changes stage (queued, converting, each epoch) and as it finishes, so a log is never silent for long."""

    def __init__(self, console: Console):
        self.console = console
        self.rows: dict[str, Update] = {}
        self.drawn = 0.0  # when the table was last redrawn (time.monotonic)
        self.said: dict[str, tuple[str, int]] = {}  # off a terminal: the last (state, epoch) printed per training
        self.live: Optional[Live] = Live(console=console, transient=True, auto_refresh=False) \
            if console.is_terminal else None

    def __enter__(self) -> LiveTable:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()

    def __call__(self, update: Update) -> None:
        previous, self.rows[update.name] = self.rows.get(update.name), update
        if self.live is not None:
            moved = previous is None or (previous.state, previous.epoch) != (update.state, update.epoch)
            if moved or time.monotonic() - self.drawn >= REDRAW_S:  # a new stage or epoch shows at once
                self.live.update(self.render(), refresh=True)
                self.drawn = time.monotonic()
        elif update.result is not None:
            row = update.result
            self.console.print(f"[green]{row.name}[/]: val top-1 {100 * row.top1:.2f}% in {row.seconds:.0f}s")
        elif self.said.get(update.name) != (update.state, update.epoch):
            self.said[update.name] = (update.state, update.epoch)
            epoch = f", epoch {update.epoch + 1}/{update.epochs}" if update.state == "running" else ""
            self.console.print(f"{update.name}: {update.state}{epoch}", highlight=False)

    def render(self) -> Table:
        """The table as it stands now; rich redraws it on each update, so the user sees every job move."""
        table = Table(title="training (each on one CPU thread)")
        for col in ("model", "state", "epoch", "steps", "val top-1"):
            table.add_column(col, justify="left" if col in ("model", "state") else "right")
        for name, u in self.rows.items():
            done = u.result is not None
            table.add_row(name, "[green]done[/]" if done else u.state, f"{u.epoch}/{u.epochs}" if u.epochs else "",
                          f"{u.step}/{u.steps}" if u.steps else "",
                          f"{100 * u.result.top1:.2f}%" if done else "")  # type: ignore[union-attr]
        return table


@user_errors
def quickstart(
    variants: str = typer.Option(",".join(SHIPPED_VARIANTS), "--variants", help="comma-separated variants"),
    epochs: Optional[int] = typer.Option(None, "--epochs", help=f"epochs per model [default: {recipe_epochs()}, the "
                                                                        "quickstart recipe's]"),
    out: Path = typer.Option(Path("runs/quickstart"), "--out", "-o", help="folder for the converted and run folders"),
    seed: SeedOpt = 0,
    scratch: bool = typer.Option(True, "--scratch/--no-scratch", help="also train each variant from scratch"),
    device: DeviceOpt = None,
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1,
                                       help="trainings run side by side, each on one CPU thread [default: CPU count]"),
    force: bool = typer.Option(False, "--force", help="overwrite the runs of an earlier quickstart in --out"),
    as_json: JsonOpt = False,
) -> None:
    """Distil the bundled digits teacher into linear-attention students and compare them with scratch.

    Example: vitconvert quickstart --variants elu,mhla --epochs 2
    """
    with loading_libraries():
        from ..quickstart import parse_variants, run_quickstart  # lazy: start-up time (and --help's)

    chosen = parse_variants(variants)
    with LiveTable(make_console(stderr=True)) as live:
        result = run_quickstart(chosen, out, epochs=epochs, seed=seed, scratch=scratch, device=device, force=force,
                                jobs=jobs, progress=live).to_dict()
    if as_json:
        typer.echo(json.dumps(result))
        return
    console.print(results_table(result))
    losers = [v for v, ok in result["beats_scratch"].items() if not ok]
    verdict = (f"[red]not above scratch: {', '.join(losers)}[/]" if losers
               else "[green]every distilled student beats its scratch twin[/]" if result["scratch"] else "")
    console.print(f"{verdict}  total {result['seconds']:.0f}s".strip())
    console.print(f"models in {out}/; try: vitconvert eval {out}/{chosen[0]} --data digits")
