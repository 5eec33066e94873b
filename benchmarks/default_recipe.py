"""The default recipe against the quickstart recipe on the digits as an image folder, 15 epochs each.

    python benchmarks/default_recipe.py                 # two distill runs (a few CPU-minutes), then the table
    python benchmarks/default_recipe.py --report-only   # the table of docs/results.md from the results file

The bundled digits are written as an image folder (1500 train / 297 val PNGs, 8×8), the bundled teacher is
converted to ELU, and each recipe distils it through the CLI exactly as docs/results.md shows. Each run's final
and best val top-1, its warm-up (as written in the recipe and as scaled to the run's epochs), its wall time and
the CPU time of its process are written to benchmarks/results/default-recipe.json, and the table between the
``default-recipe`` markers of docs/results.md is rendered from that file.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from doc_blocks import footer, measure_or_report, on_cpus

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "default-recipe.json"
DOC = ROOT / "docs" / "results.md"
BLOCK = "default-recipe"
EPOCHS = 15
RECIPES = {"default": [], "quickstart": ["--recipe", "quickstart", "--batch-size", "64"]}  # (batch 64: as recorded;
# the quickstart recipe itself moved to batch 32 at 6 epochs in issue 38)
LABELS = {"default": "default (the paper's ImageNet-style recipe: batch 512, RandAugment, mixup, cutmix, erasing)",
          "quickstart": "quickstart (batch 64, mild crops only)"}


def vitconvert(*args: str, cwd: Path) -> dict[str, float]:
    """``vitconvert ARGS`` in a child process: its wall and CPU seconds (user + system, the child's own)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vitconvert", *args], cwd=cwd, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu, 1)}


def written_warmup(recipe: str) -> Any:
    from vitconvert.recipes import load_recipe

    return load_recipe(None if recipe == "default" else recipe)[0].warmup_epochs


def run(recipe: str, work: Path) -> dict[str, Any]:
    out = work / f"run-{recipe}"
    times = vitconvert("distill", "student-elu", *RECIPES[recipe], "--data", "digits-png", "--epochs", str(EPOCHS),
                       "--set", "img_size=null", "--out", out.name, cwd=work)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [r for r in records if "val_top1" in r]
    ran = yaml.safe_load((out / "recipe.yaml").read_text())
    return {"recipe": recipe, "epochs": EPOCHS, "warmup_written": written_warmup(recipe),
            "warmup_run": ran["warmup_epochs"], "final_top1": epochs[-1]["val_top1"],
            "best_top1": max(r["val_top1"] for r in epochs), **times}


def measure() -> dict[str, Any]:
    from vitconvert.data import export_imagefolder

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export_imagefolder(work / "digits-png")
        vitconvert("convert", "digits", "--to", "elu", "--out", "student-elu", cwd=work)
        runs = [run(recipe, work) for recipe in RECIPES]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"runs": runs, "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip(),
            "cpus": os.cpu_count(), "loadavg_1min": round(os.getloadavg()[0], 1)}


def render(result: dict[str, Any]) -> str:
    """The block of docs/results.md: the commands, the table, how it was measured."""
    def command(recipe: str) -> str:
        flag = "" if recipe == "default" else f" --recipe {recipe}"
        return f"    vitconvert distill student-elu{flag} --data digits-png --epochs {EPOCHS} --set img_size=null " \
               f"--out run-{recipe}"

    lines = [*map(command, RECIPES), "",
             f"| recipe ({EPOCHS} epochs) | warm-up epochs (written → run) | val top-1, final (best) | CPU s "
             "| wall s |",
             "|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        best = "" if r["best_top1"] == r["final_top1"] else f" ({100 * r['best_top1']:.2f}%)"
        lines.append(f"| {LABELS[r['recipe']]} | {r['warmup_written']} → {r['warmup_run']} | "
                     f"{100 * r['final_top1']:.2f}%{best} | {r['cpu_s']:.0f} | {r['wall_s']:.0f} |")
    where = on_cpus(result["cpus"], None, f"load average {result['loadavg_1min']} at the end")
    lines += ["", footer(f"Measured {result['date']} at commit {result['commit']} {where}; the CPU time is the "
                         "distill process's and its loader workers'", "benchmarks/default_recipe.py",
                         str(RESULTS.relative_to(ROOT)))]
    return "\n".join(lines)


if __name__ == "__main__":
    measure_or_report(__doc__.splitlines()[0], RESULTS, measure, DOC, BLOCK, render)
