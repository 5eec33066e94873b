"""Where a budget cell's seed spread comes from: the conversion's seed or the training's.

budget.py gives one seed to both the conversion (Mimetic draws the attention weights it fits) and the distillation
(data order and crops). This script crosses them: each conversion seed with each
training seed, one variant, schedule, budget and regime, and keeps each run's per-epoch curve (metrics.jsonl's
epoch records: val top-1 and loss, the epoch's train losses), so a
diverging run or a slow start shows. The diagonal repeats budget.py's runs of the cell (the same top-1).

    python benchmarks/budget_spread.py --variant elu --schedule b32 --epochs 5 --regime transfer
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget import BASE, SCHEDULES, TASKS, task_folders  # noqa: E402
from reproduce import OPTIONS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "budget-spread.jsonl"


def run_crossed(variant: str, schedule: str, epochs: int, regime: str, convert_seed: int,
                train_seed: int) -> dict[str, Any]:
    """convert at ``convert_seed`` -> distill at ``train_seed`` -> the final top-1 and the per-epoch curve."""
    import torch

    from vitconvert import convert, save
    from vitconvert.distill import distill
    from vitconvert.distill.monitor import METRICS, read_records
    from vitconvert.sources import load_source

    torch.set_num_threads(1)
    cpu = time.process_time()
    spec, extra, heads = "digits", {}, None
    if regime in TASKS:
        source, target = task_folders(regime)
        spec, extra, heads = str(source), {"data": str(target), "img_size": None}, len(TASKS[regime][1])
    overrides = {"epochs": epochs, "seed": train_seed, **BASE, **extra, **SCHEDULES[schedule][1](epochs, regime)}
    with tempfile.TemporaryDirectory(prefix="budget-spread-") as tmp:
        work = Path(tmp)
        student, _ = convert(load_source(spec).model, to=variant, seed=convert_seed, options=OPTIONS.get(variant),
                             source=spec, num_classes=heads)
        torch.manual_seed(convert_seed)
        save(student, work / "init", pretrained=True)
        result = distill(work / "init", work / "run", recipe="quickstart", overrides=overrides, show=False,
                         device="cpu")
        records = read_records(work / "run" / METRICS)
    return {"variant": variant, "schedule": schedule, "epochs": epochs, "regime": regime,
            "convert_seed": convert_seed, "train_seed": train_seed, "top1": result.metrics["top1"],
            "curve": _curve(records), "cpu_seconds": round(time.process_time() - cpu, 2)}


def _curve(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per epoch: val top-1 (%), val loss, the epoch's train losses (total, task, attention) and the lr at its end."""
    keep = ("epoch", "val_top1", "val_loss", "train_loss", "train_task", "train_attn", "train_kd")
    out = []
    for r in (r for r in records if r.get("kind") == "epoch"):
        row = {k: round(r[k] * (100 if k == "val_top1" else 1), 4) for k in keep if k in r}
        lrs = [v for k, v in r.items() if k.startswith("lr")]
        row["lr"] = max(lrs) if lrs else None
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="elu")
    parser.add_argument("--schedule", default="b32", choices=list(SCHEDULES))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--regime", default="transfer")
    parser.add_argument("--seeds", default="0,1,2", help="crossed: every conversion seed with every training seed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    done = {(r["variant"], r["schedule"], r["epochs"], r["regime"], r["convert_seed"], r["train_seed"])
            for r in map(json.loads, args.results.read_text().splitlines() if args.results.is_file() else [])}
    for c in seeds:
        for t in seeds:
            if (args.variant, args.schedule, args.epochs, args.regime, c, t) in done:
                continue
            rec = run_crossed(args.variant, args.schedule, args.epochs, args.regime, c, t)
            with args.results.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"convert seed {c}, train seed {t}: top-1 {100 * rec['top1']:.2f} "
                  f"({rec['cpu_seconds']:.0f} CPU-s); per epoch {[e['val_top1'] for e in rec['curve']]}", flush=True)


if __name__ == "__main__":
    main()
