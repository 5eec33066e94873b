"""Accuracy against the epoch budget, per distillation schedule: how many epochs does a conversion need?

For each variant, schedule, epoch budget, seed and regime (same task / transfer, as benchmarks/reproduce.py
defines them), convert the digits teacher with the default recipe (MLPs copied, attention Mimetic), distil it
with the quickstart recipe plus the schedule's overrides, and record its final val top-1. Then write a table
(variant × budget, per schedule and regime) into docs/results.md between the ``budget`` markers and a plot of
accuracy against budget into docs/results-budget.png. The variant ``softmax`` is the ceiling: the
softmax source itself fine-tuned by the same recipe on the task loss (benchmarks/softmax_ceiling.py), transfer
regime and schedule ``paper`` only.

    python benchmarks/budget.py                                   # paper + new10, 1-20 epochs, 3 seeds
    python benchmarks/budget.py --schedules paper,tf-stage --epochs 1,2 --seeds 0 --variants elu,mhla
    python benchmarks/budget.py --report-only

Runs go one at a time by default (the machine is shared; ``--jobs 2`` runs two single-threaded ones), seed by
seed, and are appended to benchmarks/results/budget.jsonl as they finish; a rerun skips the runs already
recorded, so an interrupted sweep continues where it stopped. Transfer records carry the source teacher's
fingerprint: a retrained source teacher (benchmarks/results/transfer/ is not committed) starts them afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reproduce import (  # noqa: E402  (a sibling script, not a package)
    DOC,
    OPTIONS,
    REGIMES,
    ROOT,
    TARGET_CLASSES,
    VARIANTS,
    prepare_transfer,
    teacher_top1,
)
from softmax_ceiling import finetune_softmax  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "budget.jsonl"
PLOT = ROOT / "docs" / "results-budget.png"
BEGIN, END = "<!-- budget:begin -->", "<!-- budget:end -->"
Overrides = dict[str, Any]


def _attn_stage(epochs: int) -> Overrides:
    """Teacher-forced attention transfer for the first fifth of the budget (at least one epoch), then
    end-to-end; a 1-epoch budget has no room for two stages, so it trains jointly on teacher-forced targets."""
    if epochs < 2:
        return {"attn_target": "teacher-forced"}
    return {"attn_target": "teacher-forced", "stages": f"attn:{max(1, epochs // 5)},finetune"}


def _kd(regime: str) -> Overrides:
    """Logit KD needs the teacher's classes: same task only (a transfer student's 5 classes are other digits)."""
    return {"kd_weight": 1.0} if regime == "same" else {}


# name -> (description, overrides for an epoch budget and a regime); "paper" is quickstart as shipped
SCHEDULES: dict[str, tuple[str, Callable[[int, str], Overrides]]] = {
    "paper": ("quickstart as shipped: joint, attention MSE on own inputs", lambda e, r: {}),
    "tf": ("joint, attention MSE on teacher-forced inputs", lambda e, r: {"attn_target": "teacher-forced"}),
    "tf-stage": ("teacher-forced attention stage (epochs // 5, at least 1), then end-to-end",
                 lambda e, r: _attn_stage(e)),
    "lr10": ("joint, fresh parameters at 10× lr", lambda e, r: {"new_params": {"lr_scale": 10}}),
    "kd": ("joint + logit KD (same task only)", lambda e, r: _kd(r)),
    "lr10-kd": ("fresh parameters at 10× lr + logit KD (same task only)",
                lambda e, r: {"new_params": {"lr_scale": 10}, **_kd(r)}),
    "fast": ("teacher-forced attention stage, fresh parameters at 10× lr, logit KD (same task only)",
             lambda e, r: {**_attn_stage(e), "new_params": {"lr_scale": 10}, **_kd(r)}),
    "new10": ("joint, fresh parameters at 10× lr, a fresh head at 1× (new_params.head_lr_scale; no head here is "
              "fresh: same as lr10)",
              lambda e, r: {"new_params": {"lr_scale": 10, "head_lr_scale": 1}}),
    "new3": ("joint, fresh attention parameters at 3× lr, a fresh head at 1×",
             lambda e, r: {"new_params": {"lr_scale": 3, "head_lr_scale": 1}}),
}
CEILING = "softmax"  # the pseudo-variant: the softmax source fine-tuned the same way


def teacher_id(regime: str) -> str:
    """The source teacher's fingerprint (first 12 hex of its weights' sha256); the bundled one for same task."""
    if regime != "transfer":
        return "digits"
    source, _ = prepare_transfer()
    return hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()[:12]


def run_one(variant: str, schedule: str, epochs: int, seed: int, regime: str) -> dict[str, Any]:
    """convert (default recipe) -> save -> distill with the schedule's overrides -> final val top-1 (the
    ceiling: the softmax source fine-tuned by the same recipe); one CPU thread, as quickstart's workers."""
    import torch

    from vitconvert import convert, save
    from vitconvert.distill import distill
    from vitconvert.sources import load_source

    torch.set_num_threads(1)
    spec, extra, heads = "digits", {}, None
    if regime == "transfer":
        source, target = prepare_transfer()
        spec, extra, heads = str(source), {"data": str(target), "img_size": None}, len(TARGET_CLASSES)
    overrides = {"epochs": epochs, "seed": seed, **extra, **SCHEDULES[schedule][1](epochs, regime)}
    record = {"variant": variant, "schedule": schedule, "epochs": epochs, "seed": seed, "regime": regime,
              "teacher": teacher_id(regime), "overrides": overrides}
    if variant == CEILING:
        metrics = finetune_softmax(spec, overrides, heads)
        return {**record, "top1": metrics["top1"], "loss": metrics["loss"], "seconds": round(metrics["seconds"], 2)}
    student, _ = convert(load_source(spec).model, to=variant, seed=seed, options=OPTIONS.get(variant), source=spec,
                         num_classes=heads)
    torch.manual_seed(seed)
    work = Path(tempfile.mkdtemp(prefix=f"budget-{variant}-{schedule}-{epochs}-{seed}-"))
    try:
        start = save(student, work / "init", pretrained=True)
        result = distill(start, work / "run", recipe="quickstart", overrides=overrides, show=False, device="cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**record, "top1": result.metrics["top1"], "loss": result.metrics["loss"],
            "seconds": round(result.seconds, 2)}


def read_records(results: Path = RESULTS) -> list[dict[str, Any]]:
    if not results.is_file():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def current(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records made with today's teachers (a transfer record of another source teacher is left out)."""
    ids = {regime: teacher_id(regime) for regime in {r["regime"] for r in records}}
    seen: set[tuple] = set()
    out = []
    for r in records:  # two sweeps side by side may record a run twice: the first one counts
        if r.get("teacher", "digits" if r["regime"] == "same" else None) == ids[r["regime"]] and _key(r) not in seen:
            seen.add(_key(r))
            out.append(r)
    return out


def _key(r: dict[str, Any]) -> tuple:
    return r["variant"], r["schedule"], r["epochs"], r["seed"], r["regime"]


def planned(variants: list[str], schedules: list[str], budgets: list[int], seeds: list[int],
            regimes: list[str]) -> list[tuple]:
    """Every run to make, seed by seed (a stopped sweep leaves whole seeds), then budget, regime, variant,
    schedule; the softmax ceiling in transfer with the paper schedule only."""
    return [(v, s, e, seed, r) for seed in seeds for e in budgets for r in regimes for v in variants
            for s in schedules if v != CEILING or (r == "transfer" and s == "paper")]


def run_all(runs: list[tuple], results: Path = RESULTS, jobs: int = 1) -> None:
    done = {_key(r) for r in current(read_records(results))}
    todo = [r for r in runs if r not in done]
    print(f"{len(todo)} runs to do ({len(runs) - len(todo)} already recorded), {jobs} at a time", flush=True)
    if any(r[4] == "transfer" for r in todo):
        prepare_transfer()
    results.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=jobs) as pool:  # map keeps the order; each record is written as it comes
        for i, (args, record) in enumerate(zip(todo, pool.map(_run, todo), strict=True), 1):
            with results.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[{i}/{len(todo)}] {args[4]:8s} {args[0]:7s} {args[1]:9s} {args[2]:2d} ep seed {args[3]}: "
                  f"top-1 {100 * record['top1']:.2f}% ({record['seconds']:.0f}s)", flush=True)


def _run(args: tuple) -> dict[str, Any]:
    return run_one(*args)


# -- the report --------------------------------------------------------------------------------------
def summarise(records: list[dict[str, Any]]) -> dict[tuple, tuple[float, float, int]]:
    """(regime, schedule, variant, epochs) -> (mean, sample std, runs) of top-1 in percent."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r["regime"], r["schedule"], r["variant"], r["epochs"]), []).append(100 * r["top1"])
    return {k: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v)) for k, v in groups.items()}


def _cell(stat: tuple[float, float, int] | None) -> str:
    if not stat:
        return "–"
    mean, std, n = stat
    return f"{mean:.1f} ± {std:.1f} ({n})" if n > 1 else f"{mean:.1f} (1)"


def paired_deltas(records: list[dict[str, Any]], base: str = "paper") -> dict[tuple, list[float]]:
    """(schedule, regime, epochs, variant) -> [candidate − base top-1 in points, one per seed both ran]."""
    top1 = {_key(r): 100 * r["top1"] for r in records}
    out: dict[tuple, list[float]] = {}
    for (variant, schedule, epochs, seed, regime), value in sorted(top1.items()):
        paired = top1.get((variant, base, epochs, seed, regime))
        if schedule != base and paired is not None:
            out.setdefault((schedule, regime, epochs, variant), []).append(value - paired)
    return out


def verdict_table(records: list[dict[str, Any]]) -> str:
    """Each candidate against ``paper`` on the same seeds: mean difference and seeds won, per cell; a candidate
    is kept only where every cell of both regimes is a win on every seed."""
    deltas = paired_deltas(records)
    if not deltas:
        return ""
    variants = [v for v in VARIANTS if any(k[3] == v for k in deltas)]
    out = ["**Each candidate against `paper`, same seeds** (mean difference in points; seeds where the candidate "
           "is higher / seeds run)", "", "| schedule | regime | budget | " + " | ".join(variants) + " |",
           "|---|---|---:|" + "---:|" * len(variants)]
    for schedule, regime, epochs in sorted({k[:3] for k in deltas}, key=lambda k: (list(SCHEDULES).index(k[0]),
                                                                                  k[1], k[2])):
        cells = []
        for v in variants:
            d = deltas.get((schedule, regime, epochs, v))
            cells.append(f"{statistics.mean(d):+.1f} ({sum(x > 0 for x in d)}/{len(d)})" if d else "–")
        out.append(f"| {schedule} | {regime} | {epochs} ep | " + " | ".join(cells) + " |")
    return "\n".join(out + [""])


def markdown_tables(stats: dict) -> str:
    """One table per regime: a row per (schedule, variant), a column per epoch budget."""
    out = []
    for regime in REGIMES:
        keys = [k for k in stats if k[0] == regime]
        if not keys:
            continue
        budgets = sorted({k[3] for k in keys})
        rows = sorted({(k[1], k[2]) for k in keys},
                      key=lambda sv: (list(SCHEDULES).index(sv[0]), sv[1]))
        out += [f"**{'same task (digits 0-9)' if regime == 'same' else 'transfer (source 0-4 → target 5-9)'}**",
                "", "| schedule | variant | " + " | ".join(f"{e} ep" for e in budgets) + " |",
                "|---|---|" + "---:|" * len(budgets)]
        for schedule, variant in rows:
            cells = [_cell(stats.get((regime, schedule, variant, e))) for e in budgets]
            out.append(f"| {schedule} | {variant} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(stats: dict, path: Path) -> None:
    """A panel per regime (rows) and variant (columns): a line per schedule, the softmax ceiling (transfer) or
    the teacher (same task) in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = [r for r in REGIMES if any(k[0] == r for k in stats)]
    variants = [v for v in VARIANTS if any(k[2] == v for k in stats)]
    fig, axes = plt.subplots(len(regimes), len(variants), figsize=(3 * len(variants), 2.8 * len(regimes)),
                             squeeze=False, sharex=True)
    colors = dict(zip(SCHEDULES, plt.get_cmap("tab10").colors, strict=False))
    budgets = sorted({k[3] for k in stats})

    def line(ax: Any, regime: str, schedule: str, variant: str, **style: Any) -> None:
        points = sorted((k[3], v[0], v[1]) for k, v in stats.items() if k[:3] == (regime, schedule, variant))
        if points:
            xs, ys, es = zip(*points, strict=True)
            ax.errorbar(xs, ys, yerr=es, marker="o", markersize=3, capsize=2, **style)

    for row, regime in zip(axes, regimes, strict=True):
        for ax, variant in zip(row, variants, strict=True):
            for schedule in SCHEDULES:
                line(ax, regime, schedule, variant, color=colors[schedule], label=schedule)
            if regime == "same":
                ax.axhline(teacher_top1("same"), color="black", linewidth=1, linestyle="--", label="teacher")
            line(ax, regime, "paper", CEILING, color="black", linestyle="--", label="softmax fine-tuned")
            ax.set_title(f"{variant}, {'same task' if regime == 'same' else 'transfer'}", fontsize=9)
            ax.set_xscale("log")
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
            ax.set_ylim(0, 101)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("val top-1 (%)")
        row[0].legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("epoch budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: Path = RESULTS, doc: Path = DOC) -> None:
    """The tables into ``doc`` between the budget markers, the plot beside it (results-budget.png)."""
    records = current(read_records(results))
    if not records:
        raise SystemExit(f"no recorded runs in {results}")
    figure = doc.with_name(PLOT.name)
    stats = summarise(records)
    plot(stats, figure)
    legend = "\n".join(f"- `{name}`: {desc}" for name, (desc, _) in SCHEDULES.items()
                       if any(k[1] == name for k in stats))
    minutes = sum(r["seconds"] for r in records) / 60
    block = "\n".join([
        BEGIN,
        f"Final val top-1 (%), mean ± std (runs) per epoch budget; default convert (MLPs copied, attention "
        f"Mimetic), recipe `quickstart` plus the schedule's overrides; {len(records)} runs, {minutes:.0f} min "
        "of training. Written by `python benchmarks/budget.py` (the runs: benchmarks/results/budget.jsonl).",
        "", legend, "", markdown_tables(stats), verdict_table(records),
        f"![val top-1 against epoch budget]({figure.name})", END,
    ])
    text = doc.read_text() if doc.is_file() else "# Results\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    before, rest = text.split(BEGIN, 1)
    doc.write_text(before + block + rest.split(END, 1)[1])
    print(f"wrote {doc} and {figure}")


def _list(text: str, kind: Callable[[str], Any] = str) -> list:
    return [kind(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join((*VARIANTS, CEILING)), help="softmax: the ceiling")
    parser.add_argument("--schedules", default="paper,new10", help=f"from {', '.join(SCHEDULES)}")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one CPU thread each")
    parser.add_argument("--epochs", default="1,2,5,10,20", help="the epoch budgets")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--report-only", action="store_true", help="only rebuild docs/results.md and the plot")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSONL of runs (read and appended)")
    parser.add_argument("--doc", type=Path, default=DOC, help="the markdown file the tables go into")
    args = parser.parse_args()
    schedules, regimes = _list(args.schedules), _list(args.regimes)
    for name, allowed in (("schedule", SCHEDULES), ("regime", REGIMES), ("variant", (*VARIANTS, CEILING))):
        bad = [x for x in {"schedule": schedules, "regime": regimes, "variant": _list(args.variants)}[name]
               if x not in allowed]
        if bad:
            raise SystemExit(f"error: unknown {name} {', '.join(bad)} (choose from {', '.join(allowed)})")
    if not args.report_only:
        runs = planned(_list(args.variants), schedules, _list(args.epochs, int), _list(args.seeds, int), regimes)
        run_all(runs, args.results, args.jobs)
    write_report(args.results, args.doc)


if __name__ == "__main__":
    main()
