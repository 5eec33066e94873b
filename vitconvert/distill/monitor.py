"""What a run reports: metrics.jsonl (always), TensorBoard (when installed), a rich progress bar, a PNG.

metrics.jsonl holds one JSON object per line: ``{"kind": "step", ...}`` every log_interval optimizer steps
and ``{"kind": "epoch", ...}`` after each validation. A resumed run first drops records past its
checkpoint, so the file reads as if the run had never stopped.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

METRICS = "metrics.jsonl"
CURVES = "curves.png"


def read_records(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records; a line cut short by a crash is skipped, not an error on resume."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return records


class Monitor:
    """Writes records on rank 0; other ranks hold a disabled one."""

    def __init__(self, run: Path, enabled: bool, keep_until: Optional[tuple[int, int]] = None):
        self.path = run / METRICS
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        if keep_until is not None:  # resuming: (completed epochs, optimizer steps) of the checkpoint
            epochs, step = keep_until
            kept = [r for r in read_records(self.path)
                    if (r.get("kind") == "epoch" and r.get("epoch", 0) <= epochs)
                    or (r.get("kind") == "step" and r.get("step", 0) <= step)]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, record: dict[str, Any]) -> None:
        """Append one record to metrics.jsonl (and TensorBoard, when on); only the main process writes."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = "epoch" if record.get("kind") == "epoch" else "train"
            x = record.get("step", 0)
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch") and math.isfinite(value):
                    self.tb.add_scalar(f"{prefix}/{key}", value, x)
            self.tb.flush()

    def epochs(self) -> list[dict[str, Any]]:
        """The epoch records so far, resumed runs included: the curves and the card read these."""
        return [r for r in read_records(self.path) if r.get("kind") == "epoch"]

    def close(self) -> None:
        """Flush and close TensorBoard's writer, so its last events reach the disk."""
        if self.tb is not None:
            self.tb.close()


def plot_curves(run: Path) -> Optional[Path]:
    """Training loss per step and validation top-1 per epoch as a PNG (only when matplotlib is installed).

    A bare Figure, no pyplot: no GUI backend is chosen or switched in the caller's process."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    records = read_records(run / METRICS)
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    fig = Figure(figsize=(10, 3.6), layout="constrained")  # a little cheaper than tight_layout's extra draw
    left, right = fig.subplots(1, 2)
    for key in ("loss", "task", "attn", "kd"):
        points = [(r["step"], r[key]) for r in steps if key in r]
        if points:
            left.plot(*zip(*points, strict=True), label=key)
    left.set_xlabel("optimizer step")
    left.set_ylabel("training loss")
    left.set_yscale("log")
    left.legend()
    for key in ("val_top1", "val_top5"):
        points = [(r["epoch"], 100 * r[key]) for r in epochs if r.get(key) is not None]  # top-5: None for ≤ 5 classes
        if points:
            right.plot(*zip(*points, strict=True), marker="o", label=key.removeprefix("val_"))
    right.set_xlabel("epoch")
    right.set_ylabel("validation accuracy (%)")
    right.legend()
    fig.suptitle(run.name)
    out = run / CURVES
    fig.savefig(out, dpi=110)
    return out


LOG_EVERY_S = 30.0  # off a terminal (a log file, a pipe): a progress line at most this often within an epoch


class Bar:
    """Epoch lines and, on a terminal, a rich progress bar per epoch (loss terms, img/s, ETA), on stderr; off a
    terminal, where a bar cannot draw, a plain progress line every LOG_EVERY_S seconds instead of silence."""

    def __init__(self, show: bool):
        self.console = Console(stderr=True, width=None if sys.stderr.isatty() else 100_000)  # logs: whole lines
        self.show = show
        self.animate = show and self.console.is_terminal
        self.progress: Optional[Progress] = None
        self.task: Any = None
        self.description, self.total, self.done, self.terms = "", 0, 0, ""
        self.last_line = time.monotonic()

    def start(self, description: str, total: int, done: int) -> None:
        """Begin an epoch's progress: a live bar at a terminal, a line every few seconds otherwise."""
        self.description, self.total, self.done = description, total, done
        self.last_line = time.monotonic()
        if not self.animate:
            return
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[terms]}"), TimeRemainingColumn(), console=self.console,
                                 transient=True)
        self.progress.start()
        self.task = self.progress.add_task(description, total=total, completed=done, terms="")

    def advance(self, terms: Optional[str] = None) -> None:
        """One optimizer step done, with the loss terms to show."""
        self.done += 1
        self.terms = terms if terms is not None else self.terms
        if self.progress is not None:
            self.progress.update(self.task, advance=1, **({"terms": terms} if terms is not None else {}))
        elif self.show and time.monotonic() - self.last_line >= LOG_EVERY_S:
            self.print(f"{self.description} step {self.done}/{self.total} {self.terms}".rstrip())
            self.last_line = time.monotonic()

    def stop(self) -> None:
        """End the live bar, so the lines after it print below it."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def print(self, line: str) -> None:
        """Print a line above the bar; silent where output is off (other ranks than the main one, a quiet run)."""
        if self.show:
            self.console.print(line, highlight=False, soft_wrap=True)
