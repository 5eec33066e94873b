"""Where a budget cell's seed spread comes from: the conversion's seed or the training's.

budget.py gives one seed to both the conversion (Mimetic draws the attention weights it fits) and the distillation
(data order and crops). This script crosses them: each conversion seed with each
training seed, one variant, schedule, budget and regime, and keeps each run's per-epoch curve (metrics.jsonl's
epoch records: val top-1 and loss, the epoch's train losses), so a
diverging run or a slow start shows. The diagonal repeats budget.py's runs of the cell (the same top-1).
A TTT run also records its trained layers' state (``ttt_state``): per layer the fast weights' RMS (init 0.02) and
the inner step's share of the attention output on 64 val images of digits 5-9, so a step grown too large shows.

    python benchmarks/budget_spread.py --variant elu --schedule b32 --epochs 5 --regime transfer
"""

from __future__ import annotations

import argparse
import json
import statistics
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

    from vitconvert import convert, load, save
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
        state = ttt_state(load(work / "run")) if variant == "ttt" else None
    return {"variant": variant, "schedule": schedule, "epochs": epochs, "regime": regime,
            "convert_seed": convert_seed, "train_seed": train_seed, "top1": result.metrics["top1"],
            "curve": _curve(records), "cpu_seconds": round(time.process_time() - cpu, 2),
            **({"ttt_state": state} if state else {})}


def ttt_state(model: Any) -> list[dict[str, float]]:
    """Per TTT layer: the fast weights' RMS and the inner step's share |out − out at inner_lr 0| / |out| of the
    attention output, each layer fed its own input of a forward over 64 val images of digits 5-9."""
    import torch
    from ttt_transfer import target_batch

    layers = [b.attn for b in model.blocks]
    inputs: list[Any] = []
    hooks = [m.register_forward_hook(lambda m, i, o: inputs.append(i[0])) for m in layers]
    with torch.no_grad():
        model.eval()(target_batch(model))
        for h in hooks:
            h.remove()
        out = []
        for m, x in zip(layers, inputs, strict=True):
            stepped, lr = m(x), m.inner_lr
            m.inner_lr = 0.0
            unstepped = m(x)
            m.inner_lr = lr
            fast = torch.cat([w.flatten() for w in (m.fast_w1, m.fast_w2, m.fast_w3)])
            out.append({"fast_rms": round(fast.pow(2).mean().sqrt().item(), 5),
                        "step_share": round(((stepped - unstepped).norm() / stepped.norm()).item(), 5)})
    return out


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


def render(variant: str, schedules: list[str], epochs: int, regime: str, results: Path = RESULTS) -> str:
    """Per schedule: the crossed top-1s (conversion seed × training seed) with their means, the mean per-epoch
    curve, and for TTT each layer's mean fast-weight RMS and step share at the end."""
    runs = [r for r in map(json.loads, results.read_text().splitlines())
            if (r["variant"], r["epochs"], r["regime"]) == (variant, epochs, regime)]
    out = []
    for schedule in schedules:
        mine = {(r["convert_seed"], r["train_seed"]): r for r in runs if r["schedule"] == schedule}
        out += [f"**`{schedule}`**, {variant}, {regime}, {epochs} epochs: val top-1 (%)", "", *_crossed(mine),
                "", _curves([r["curve"] for r in mine.values()]), *_state([r for r in mine.values()]), ""]
    command = f"benchmarks/budget_spread.py --variant {variant} --epochs {epochs} --regime {regime} --schedule"
    return "\n".join(out + ["Written by " + " and ".join(f"`python {command} {s}`" for s in schedules)
                            + f" (benchmarks/results/{results.name})."])


def _crossed(runs: dict[tuple[int, int], dict[str, Any]]) -> list[str]:
    """The table: a row per conversion seed, a column per training seed, each with its mean; all runs' mean ± std."""
    seeds = sorted({c for c, _ in runs})
    top1 = {k: 100 * r["top1"] for k, r in runs.items()}
    lines = ["| conversion seed ↓ / training seed → | " + " | ".join(map(str, seeds)) + " | mean |",
             "|---|" + "---:|" * (len(seeds) + 1)]
    for c in seeds:
        row = [top1[(c, t)] for t in seeds]
        lines.append(f"| {c} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {statistics.mean(row):.2f} |")
    columns = [statistics.mean(top1[(c, t)] for c in seeds) for t in seeds]
    every = list(top1.values())
    return lines + ["| mean | " + " | ".join(f"{x:.2f}" for x in columns) +
                    f" | {statistics.mean(every):.2f} ± {statistics.stdev(every):.2f} ({len(every)}) |"]


def _curves(curves: list[list[dict[str, float]]]) -> str:
    epochs = range(len(curves[0]))
    top1 = [statistics.mean(c[e]["val_top1"] for c in curves) for e in epochs]
    loss = [statistics.mean(c[e]["val_loss"] for c in curves) for e in epochs]
    return ("Mean over the runs, per epoch: val top-1 " + ", ".join(f"{x:.1f}" for x in top1) + "; val loss "
            + ", ".join(f"{x:.3f}" for x in loss) + ".")


def _state(runs: list[dict[str, Any]]) -> list[str]:
    states = [r["ttt_state"] for r in runs if "ttt_state" in r]
    if not states:
        return []
    layers = range(len(states[0]))
    rms = [statistics.mean(s[i]["fast_rms"] for s in states) for i in layers]
    share = [statistics.mean(s[i]["step_share"] for s in states) for i in layers]
    return ["At the end, per layer (mean of the runs): fast-weight RMS " + ", ".join(f"{x:.4f}" for x in rms)
            + " (init 0.02); the inner step's share of the attention output " + ", ".join(f"{x:.2f}" for x in share)
            + "."]


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
            state = [(s["fast_rms"], s["step_share"]) for s in rec.get("ttt_state", [])]
            print(f"convert seed {c}, train seed {t}: top-1 {100 * rec['top1']:.2f} "
                  f"({rec['cpu_seconds']:.0f} CPU-s); per epoch {[e['val_top1'] for e in rec['curve']]}"
                  + (f"; per layer (fast RMS, step share) {state}" if state else ""), flush=True)


if __name__ == "__main__":
    main()
