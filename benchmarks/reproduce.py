"""The paper's comparison at toy scale: what to copy and what to distil, on the bundled digits.

For every variant and seed, at one equal epoch budget (the quickstart recipe), train a student from each
init configuration below through ``vitconvert.convert`` and ``vitconvert.distill`` exactly as a user would,
and record its final validation top-1. Then write the mean ± std table and a plot into docs/results.md
(between the ``reproduce`` markers, leaving the prose around them alone) and docs/results.png.

    python benchmarks/reproduce.py                  # 5 variants × 3 seeds × 8 configs = 120 runs, 2 workers
    python benchmarks/reproduce.py --jobs 8         # on a bigger machine (each worker gets cores / jobs threads)
    python benchmarks/reproduce.py --report-only    # rebuild table and plot from the recorded runs
    python benchmarks/reproduce.py --regime transfer   # the paper's setting: source task != target task

``--regime transfer`` is the paper's regime at toy scale: the softmax teacher is pretrained on a *source*
task (digits 0-4, by benchmarks/train_digits_teacher.py's recipe, 60 epochs), and every student is converted
from it with 5 classes (the source's own 5-way head, kept where the configuration copies the rest: convert
re-heads only when the class count changes) and trained on a *different* target task (digits 5-9, as an image
folder). The distillation teacher is the source model as pretrained, not fine-tuned on the target: its
attention outputs on target images are what the students distil. Records carry ``regime``; the table goes
between the ``reproduce-transfer`` markers of docs/results.md, the plot to docs/results-transfer.png.

Every finished run is appended to benchmarks/results/reproduce.jsonl; a rerun skips runs already recorded
with the same settings, so an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from budget_schedules import BASE  # (batch 64: the recipe every recorded run was made with)
from doc_blocks import write_block, write_results

from vitconvert.attention import VARIANTS as ALL_VARIANTS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "reproduce.jsonl"
DOC = ROOT / "docs" / "results.md"
PLOT = ROOT / "docs" / "results.png"
REGIMES = ("same", "transfer")
SOURCE_CLASSES, TARGET_CLASSES = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
TRANSFER_DIR = ROOT / "benchmarks" / "results" / "transfer"  # the source teacher and the target image folder
SOURCE_EPOCHS = 60
VARIANTS = tuple(ALL_VARIANTS)
OPTIONS: dict[str, dict[str, Any]] = {"mhla": {"blocks_per_side": 2}}  # 2×2 token-level heads on the 4×4 grid


@dataclass(frozen=True)
class Config:
    """One init configuration of the paper's ablation: what each parameter group starts from, and the loss."""

    name: str
    label: str
    attn_init: str
    mlp_init: str
    rest_init: str
    distill: bool


CONFIGS = (
    Config("scratch", "scratch (all random)", "random", "random", "random", False),
    Config("attn-copy", "attention copied, rest random", "copy", "random", "random", False),
    Config("mlp+random", "MLPs copied, attention random", "random", "copy", "copy", False),
    Config("mlp+random+d", "MLPs copied, attention random, distilled", "random", "copy", "copy", True),
    Config("mlp+copy", "MLPs copied, attention copied", "copy", "copy", "copy", False),
    Config("mlp+copy+d", "MLPs copied, attention copied, distilled", "copy", "copy", "copy", True),
    Config("mlp+mimetic", "MLPs copied, attention Mimetic", "mimetic", "copy", "copy", False),
    Config("mlp+mimetic+d", "MLPs copied, attention Mimetic, distilled", "mimetic", "copy", "copy", True),
)
BY_NAME = {c.name: c for c in CONFIGS}


def prepare_transfer(source_classes: tuple[int, ...] = SOURCE_CLASSES, target_classes: tuple[int, ...] = TARGET_CLASSES,
                     root: Path = TRANSFER_DIR) -> tuple[Path, Path]:
    """(source teacher folder, target image folder) under ``root``, made once: a softmax teacher trained on the
    digits of ``source_classes`` (0-4) and those of ``target_classes`` (5-9) as train/ and val/ class folders
    (timm numbers them from 0 in sorted order)."""
    import sys

    import timm

    from vitconvert.data import digits_dataset

    span = f"{target_classes[0]}to{target_classes[-1]}"
    source, target = root / "source-teacher", root / f"target-digits-{span}"
    if not (source / "model.safetensors").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_digits_teacher import train

        model, top1 = train(SOURCE_EPOCHS, 64, 2e-3, 0, source_classes)
        timm.models.save_for_hf(model, str(source), safe_serialization=True)
        (source / "training.json").write_text(json.dumps({"classes": source_classes, "epochs": SOURCE_EPOCHS,
                                                          "val_top1": round(top1, 4)}) + "\n")
        print(f"source teacher (digits {source_classes[0]}-{source_classes[-1]}): val top-1 {100 * top1:.2f}%",
              flush=True)
    if not (target / "val").is_dir():
        for split in ("train", "val"):
            ds = digits_dataset(split)
            for i, label in enumerate(ds.targets):
                if label in target_classes:
                    folder = target / split / str(label)
                    folder.mkdir(parents=True, exist_ok=True)
                    ds.image(i).save(folder / f"{int(ds.indices[i]):04d}.png")
    return source, target


def run_one(variant: str, config: Config, seed: int, epochs: int, threads: int,
            regime: str = "same") -> dict[str, Any]:
    """convert -> save -> distill (attention loss on or off) -> the run's final val top-1; folders are discarded."""
    import torch

    from vitconvert import convert, save
    from vitconvert.distill import distill
    from vitconvert.sources import load_source

    torch.set_num_threads(threads)
    spec, extra, heads = "digits", {}, None
    if regime == "transfer":  # the source teacher, re-headed students, the target folder
        source, target = prepare_transfer()
        spec, extra, heads = str(source), {"data": str(target), "img_size": None}, len(TARGET_CLASSES)
    teacher = load_source(spec).model
    student, _ = convert(teacher, to=variant, attn_init=config.attn_init, mlp_init=config.mlp_init,
                         rest_init=config.rest_init, seed=seed, options=OPTIONS.get(variant), source=spec,
                         num_classes=heads)
    work = Path(tempfile.mkdtemp(prefix=f"reproduce-{variant}-{config.name}-{seed}-"))
    try:
        start = save(student, work / "init", pretrained=True)
        overrides = {"epochs": epochs, "seed": seed, **BASE, "attn_weight": 1.0 if config.distill else 0.0,
                     "kd_weight": 0.0, **extra}
        result = distill(start, work / "run", recipe="quickstart", overrides=overrides, show=False, device="cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"variant": variant, "config": config.name, "seed": seed, "epochs": epochs, "regime": regime,
            "top1": result.metrics["top1"], "top5": result.metrics["top5"], "loss": result.metrics["loss"],
            "seconds": round(result.seconds, 2)}


def read_records(epochs: int, regime: str = "same") -> list[dict[str, Any]]:
    if not RESULTS.is_file():
        return []
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("epochs") == epochs and r.get("kind", "run") == "run"
            and r.get("regime", "same") == regime]


def run_all(variants: list[str], seeds: list[int], epochs: int, jobs: int, regime: str = "same") -> None:
    if regime == "transfer":
        prepare_transfer()  # once, before the workers start
    done = {(r["variant"], r["config"], r["seed"]) for r in read_records(epochs, regime)}
    todo = [(v, c, s) for v in variants for s in seeds for c in CONFIGS if (v, c.name, s) not in done]
    print(f"{len(todo)} runs to do ({len(done)} already recorded), {epochs} epochs each, {jobs} job(s)", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, v, c, s, epochs, threads, regime): (v, c.name, s) for v, c, s in todo}
        for i, future in enumerate(as_completed(futures), 1):
            record = future.result()
            with RESULTS.open("a") as f:
                f.write(json.dumps(record) + "\n")
            elapsed = time.perf_counter() - started
            print(f"[{i}/{len(todo)}] {record['variant']:6s} {record['config']:14s} seed {record['seed']}: "
                  f"top-1 {100 * record['top1']:.2f}% ({record['seconds']:.0f}s; {elapsed / 60:.1f} min so far)",
                  flush=True)


# -- the report --------------------------------------------------------------------------------------
def summarise(records: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[float, float, int]]:
    """(variant, config) -> (mean, std, runs) of top-1 in percent; std is the sample std over seeds."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in records:
        groups.setdefault((r["variant"], r["config"]), []).append(100 * r["top1"])
    return {k: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for k, v in groups.items()}


def teacher_top1(regime: str = "same") -> float:
    """The softmax teacher's val top-1: on the digits (same task), or on its own source task (transfer)."""
    from vitconvert.evaluate import evaluate
    from vitconvert.sources import load_source

    if regime == "transfer":
        return 100 * json.loads((prepare_transfer()[0] / "training.json").read_text())["val_top1"]
    return 100 * evaluate(load_source("digits").model, "digits", device="cpu")["top1"]


def markdown_table(stats: dict, variants: list[str], teacher: float,
                   teacher_label: str = "softmax teacher (one model)") -> str:
    head = "| configuration | " + " | ".join(variants) + " |"
    lines = [head, "|---|" + "---:|" * len(variants)]
    for c in CONFIGS:
        cells = []
        for v in variants:
            mean, std, n = stats.get((v, c.name), (float("nan"), 0.0, 0))
            cells.append(f"{mean:.1f} ± {std:.1f}" if n else "–")
        lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    lines.append(f"| {teacher_label} | " + " | ".join(f"{teacher:.1f}" for _ in variants) + " |")
    return "\n".join(lines)


def plot(stats: dict, variants: list[str], teacher: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(CONFIGS)
    colors = plt.get_cmap("tab10").colors
    for i, c in enumerate(CONFIGS):
        xs = [j + (i - (len(CONFIGS) - 1) / 2) * width for j in range(len(variants))]
        means = [stats.get((v, c.name), (float("nan"), 0, 0))[0] for v in variants]
        stds = [stats.get((v, c.name), (0, 0.0, 0))[1] for v in variants]
        ax.bar(xs, means, width, yerr=stds, capsize=2, label=c.label, color=colors[i % len(colors)],
               hatch="//" if c.distill else None, edgecolor="white", linewidth=0.5)
    ax.axhline(teacher, color="black", linestyle="--", linewidth=1, label=f"softmax teacher ({teacher:.1f}%)")
    ax.set_xticks(range(len(variants)), variants)
    ax.set_ylabel("digits val top-1 (%)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_path(regime: str) -> Path:
    return RESULTS.parent / ("reproduce-transfer-summary.json" if regime == "transfer" else "reproduce-summary.json")


def block_name(regime: str) -> str:
    return "reproduce-transfer" if regime == "transfer" else "reproduce"


def render(regime: str = "same", epochs: int = 5) -> str:
    """The block of docs/results.md for ``regime``, from the recorded runs and the summary file (the teacher's
    top-1, the environment): nothing is measured here."""
    records = read_records(epochs, regime)
    if not records:
        raise SystemExit(f"no recorded {regime}-task runs with {epochs} epochs in {RESULTS}")
    summary = json.loads(summary_path(regime).read_text())
    stats = summarise(records)
    shown = [v for v in VARIANTS if any(k[0] == v for k in stats)]
    transfer = regime == "transfer"
    figure = PLOT.with_name("results-transfer.png") if transfer else PLOT
    label = "softmax source teacher, on its source task 0-4" if transfer else "softmax teacher (one model)"
    seeds = sorted({r["seed"] for r in records})
    minutes = sum(r["seconds"] for r in records) / 60
    what = ("Target-task (digits 5-9) val top-1 (%)" if transfer else "Digits val top-1 (%)")
    return "\n".join([
        f"{what}, mean ± std over seeds {', '.join(map(str, seeds))}; {epochs} epochs per run, "
        f"recipe `recipes/quickstart.yaml` at batch 64 (as shipped until issue 38); {len(records)} runs, "
        f"{minutes:.0f} min of training in all "
        f"({summary['environment']}). "
        f"Written by `python benchmarks/reproduce.py{' --regime transfer' if transfer else ''}`.",
        "",
        markdown_table(stats, shown, summary["teacher_top1"], label),
        "",
        f"![{what} per variant and init configuration]({figure.name})",
    ])


def write_report(variants: list[str], epochs: int, regime: str = "same") -> None:
    """The summary file (the teacher measured again), then the plot and the doc's block rendered from the files."""
    records = read_records(epochs, regime)
    if not records:
        raise SystemExit(f"no recorded {regime}-task runs with {epochs} epochs in {RESULTS}")
    stats = summarise(records)
    shown = [v for v in variants if any(k[0] == v for k in stats)]
    teacher = teacher_top1(regime)
    import timm
    import torch

    write_results(summary_path(regime), {
        "epochs": epochs, "seeds": sorted({r["seed"] for r in records}), "teacher_top1": teacher,
        "environment": f"{platform.machine()}, torch {torch.__version__.split('+')[0]}, timm {timm.__version__}",
        "mean_std_runs": {f"{v}/{c}": list(s) for (v, c), s in sorted(stats.items())}})
    figure = PLOT.with_name("results-transfer.png") if regime == "transfer" else PLOT
    plot(stats, shown, teacher, figure)
    write_block(DOC, block_name(regime), render(regime, epochs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=5, help="the equal epoch budget of every run")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs; the CPU threads are split evenly")
    parser.add_argument("--report-only", action="store_true", help="only rebuild docs/results.md and the plot")
    parser.add_argument("--regime", choices=REGIMES, default="same",
                        help="same: the teacher's own task; transfer: pretrained on digits 0-4, trained on 5-9")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not args.report_only:
        run_all(variants, seeds, args.epochs, args.jobs, args.regime)
    write_report(variants, args.epochs, args.regime)


if __name__ == "__main__":
    main()
