"""Accuracy against the epoch budget, per distillation schedule: how many epochs does a conversion need?

For each variant, schedule, epoch budget, seed and regime (same task / transfer, as benchmarks/reproduce.py
defines them), convert the digits teacher with the default recipe (MLPs copied, attention Mimetic), distil it
with the quickstart recipe plus the schedule's overrides, and record its final val top-1. Then write a table
(variant × budget, per schedule and regime) into docs/results.md between the ``budget`` markers and a plot of
accuracy against budget into docs/results-budget.png. The variant ``softmax`` is the ceiling: the
softmax source itself fine-tuned by the same recipe on the task loss (benchmarks/softmax_ceiling.py), transfer
regime and schedule ``paper`` only. Regime ``reheaded`` is a transfer that changes the class count (a source
teacher trained on digits 0-6, target 7-9), so every student gets a fresh head and ``new_params.head_lr_scale``
acts; ``--results``/``--block`` put a sweep in its own file and docs block (each record carries its CPU-seconds).

    python benchmarks/budget.py                                   # paper + new10, 1-20 epochs, 3 seeds
    python benchmarks/budget.py --schedules paper,tf-stage --epochs 1,2 --seeds 0 --variants elu,mhla
    python benchmarks/budget.py --report-only --versus paper,b32  # also each b32-* schedule against b32

Runs go one at a time by default (the machine is shared; ``--jobs 2`` runs two single-threaded ones), seed by
seed, and are appended to benchmarks/results/budget.jsonl as they finish; a rerun skips the runs already
recorded, so an interrupted sweep continues where it stopped. A SIGTERM or Ctrl-C (to the sweep or to one of its
workers) stops every training at its step with a checkpoint and ends the sweep; the same command resumes each
stopped run from its checkpoint (budget_pool.py). Transfer records carry the source teacher's
fingerprint: a retrained source teacher starts them afresh (retraining does not give the same weights across
machines and versions, so the source teacher the tables use is committed: benchmarks/results/transfer/source-teacher).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_pool import run_pool  # noqa: E402
from budget_schedules import BASE, CONVERT_OPTIONS, DERIVED_FROM, SCHEDULES  # noqa: E402
from reproduce import (  # noqa: E402  (a sibling script, not a package)
    DOC,
    OPTIONS,
    REGIMES,
    ROOT,
    SOURCE_CLASSES,
    TARGET_CLASSES,
    TRANSFER_DIR,
    VARIANTS,
    prepare_transfer,
    teacher_top1,
)
from softmax_ceiling import finetune_softmax  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "budget.jsonl"
PLOT = ROOT / "docs" / "results-budget.png"
CEILING = "softmax"  # the pseudo-variant: the softmax source fine-tuned the same way
# regime -> (source classes, target classes, folder) of a source teacher and a target task; "reheaded" changes
# the class count (7 -> 3), so convert gives every student a fresh head, as a real transfer does
TASKS: dict[str, tuple[tuple[int, ...], tuple[int, ...], Path]] = {
    "transfer": (SOURCE_CLASSES, TARGET_CLASSES, TRANSFER_DIR),
    "reheaded": (tuple(range(7)), (7, 8, 9), TRANSFER_DIR.with_name("transfer-reheaded")),
}


ALL_REGIMES = tuple(dict.fromkeys((*REGIMES, *TASKS)))
TITLES = {"same": "same task (digits 0-9)", "transfer": "transfer (source 0-4 → target 5-9)",
          "reheaded": "re-headed transfer (source 0-6, 7 classes → target 7-9, 3 classes: every head is fresh)"}


def task_folders(regime: str) -> tuple[Path, Path]:
    """(source teacher, target image folder) of a transfer regime, made once (reproduce.prepare_transfer)."""
    return prepare_transfer(*TASKS[regime])


def teacher_id(regime: str) -> str:
    """The source teacher's fingerprint (first 12 hex of its weights' sha256); the bundled one for same task."""
    if regime not in TASKS:
        return "digits"
    source, _ = task_folders(regime)
    return hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()[:12]


def work_folder(results: Path, run: tuple) -> Path:
    """Where a run trains: one folder per results file and run, kept when the run is stopped (its checkpoint) and
    removed when it is recorded."""
    return Path(tempfile.gettempdir()) / "vitconvert-budget" / results.stem / "-".join(map(str, run))


def run_one(variant: str, schedule: str, epochs: int, seed: int, regime: str,
            work: Optional[Path] = None) -> dict[str, Any]:
    """convert (default recipe) -> save -> distill with the schedule's overrides -> final val top-1 (the
    ceiling: the softmax source fine-tuned by the same recipe); one CPU thread, as quickstart's workers.

    In ``work`` a stopped run (SIGTERM, Ctrl-C: the trainer saves checkpoint-last and raises TrainingStopped)
    keeps its folder and the CPU-seconds it spent, and the next call resumes it from its checkpoint."""
    import torch

    from vitconvert import convert, save
    from vitconvert.distill import distill
    from vitconvert.sources import load_source

    torch.set_num_threads(1)
    cpu = time.process_time()  # this worker's CPU-seconds: the machine is shared, so wall time is not the cost
    spec, extra, heads = "digits", {}, None
    if regime in TASKS:
        source, target = task_folders(regime)
        spec, extra, heads = str(source), {"data": str(target), "img_size": None}, len(TASKS[regime][1])
    overrides = {"epochs": epochs, "seed": seed, **BASE, **extra, **SCHEDULES[schedule][1](epochs, regime)}
    record = {"variant": variant, "schedule": schedule, "epochs": epochs, "seed": seed, "regime": regime,
              "teacher": teacher_id(regime), "overrides": overrides}
    if variant == CEILING:
        metrics = finetune_softmax(spec, overrides, heads)
        return {**record, "top1": metrics["top1"], "loss": metrics["loss"], "seconds": round(metrics["seconds"], 2),
                "cpu_seconds": round(time.process_time() - cpu, 2)}
    work = work or Path(tempfile.mkdtemp(prefix=f"budget-{variant}-{schedule}-{epochs}-{seed}-"))
    spent = work / "cpu_seconds.json"  # what the stopped part of a resumed run cost
    resume = (work / "run" / "checkpoint-last").is_dir()
    before = json.loads(spent.read_text()) if resume and spent.is_file() else {"cpu": 0.0, "seconds": 0.0}
    if not resume:
        shutil.rmtree(work, ignore_errors=True)
        options = {**OPTIONS.get(variant, {}), **CONVERT_OPTIONS.get(schedule, {})} or None
        student, _ = convert(load_source(spec).model, to=variant, seed=seed, options=options,
                             source=spec, num_classes=heads)
        torch.manual_seed(seed)
        save(student, work / "init", pretrained=True)
    started = time.perf_counter()
    try:
        result = distill(work / "init", work / "run", recipe="quickstart", overrides=overrides, show=False,
                         device="cpu", resume=resume)
    except BaseException:
        spent.write_text(json.dumps({"cpu": before["cpu"] + time.process_time() - cpu,
                                     "seconds": before["seconds"] + time.perf_counter() - started}))
        raise
    shutil.rmtree(work, ignore_errors=True)
    return {**record, "top1": result.metrics["top1"], "loss": result.metrics["loss"],
            "seconds": round(before["seconds"] + result.seconds, 2),
            "cpu_seconds": round(before["cpu"] + time.process_time() - cpu, 2), **({"resumed": True} if resume else {})}


def read_records(results: Path = RESULTS) -> list[dict[str, Any]]:
    if not results.is_file():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def current(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records made with today's teachers (a transfer record of another source teacher is left out)."""
    ids = {regime: _teacher_of(regime, records) for regime in {r["regime"] for r in records}}
    seen: set[tuple] = set()
    out = []
    for r in records:  # two sweeps side by side may record a run twice: the first one counts
        if r.get("teacher", "digits" if r["regime"] == "same" else None) == ids[r["regime"]] and _key(r) not in seen:
            seen.add(_key(r))
            out.append(r)
    return out


def _teacher_of(regime: str, records: list[dict[str, Any]]) -> str:
    """The source teacher on disk; where there is none (the re-headed regime's is not committed), the one
    of the regime's last record, so a report never trains a teacher."""
    if regime in TASKS and not (TASKS[regime][2] / "source-teacher" / "model.safetensors").is_file():
        return [r.get("teacher") for r in records if r["regime"] == regime][-1]
    return teacher_id(regime)


def _key(r: dict[str, Any]) -> tuple:
    return r["variant"], r["schedule"], r["epochs"], r["seed"], r["regime"]


def planned(variants: list[str], schedules: list[str], budgets: list[int], seeds: list[int],
            regimes: list[str]) -> list[tuple]:
    """Every run to make, seed by seed (a stopped sweep leaves whole seeds), then budget, regime, variant,
    schedule; the softmax ceiling in transfer with the paper schedule only."""
    return [(v, s, e, seed, r) for seed in seeds for e in budgets for r in regimes for v in variants
            for s in schedules if v != CEILING or (r in TASKS and s == "paper")]


def run_all(runs: list[tuple], results: Path = RESULTS, jobs: int = 1) -> None:
    """Every run not yet recorded, ``jobs`` at a time, each record appended as it comes; a stop signal (to this
    process or a worker) saves each training's checkpoint and ends the sweep: the same command resumes it."""
    done = {_key(r) for r in current(read_records(results))}
    todo = [r for r in runs if r not in done]
    print(f"{len(todo)} runs to do ({len(runs) - len(todo)} already recorded), {jobs} at a time", flush=True)
    for regime in sorted({r[4] for r in todo} & set(TASKS)):
        task_folders(regime)
    results.parent.mkdir(parents=True, exist_ok=True)
    count = iter(range(1, len(todo) + 1))

    def record(args: tuple, rec: dict[str, Any]) -> None:
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{next(count)}/{len(todo)}] {args[4]:8s} {args[0]:7s} {args[1]:9s} {args[2]:2d} ep seed {args[3]}: "
              f"top-1 {100 * rec['top1']:.2f}% ({rec['seconds']:.0f}s, {rec['cpu_seconds']:.0f} CPU-s)", flush=True)

    ended = run_pool(run_one, [(*r, work_folder(results, r)) for r in todo], jobs, lambda a, rec: record(a[:5], rec))
    if ended is not None:
        code, line = ended
        print(f"{line}; the stopped runs keep their checkpoints: run the same command again to resume", flush=True)
        raise SystemExit(code)


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


def verdict_table(records: list[dict[str, Any]], base: str = "paper") -> str:
    """Each candidate against ``base`` on the same seeds (against any other base than ``paper``: the schedules
    named ``base-*`` or derived from it in DERIVED_FROM): mean difference and seeds won, per cell; a candidate is
    kept only where every cell of both regimes is a win on every seed."""
    deltas = {k: d for k, d in paired_deltas(records, base).items()
              if base == "paper" or k[0].startswith(base + "-") or DERIVED_FROM.get(k[0]) == base}
    if not deltas:
        return ""
    variants = [v for v in VARIANTS if any(k[3] == v for k in deltas)]
    out = [f"**Each candidate against `{base}`, same seeds** (mean difference in points; seeds where the candidate "
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
    for regime in ALL_REGIMES:
        keys = [k for k in stats if k[0] == regime]
        if not keys:
            continue
        budgets = sorted({k[3] for k in keys})
        rows = sorted({(k[1], k[2]) for k in keys},
                      key=lambda sv: (list(SCHEDULES).index(sv[0]), sv[1]))
        out += [f"**{TITLES[regime]}**",
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

    regimes = [r for r in ALL_REGIMES if any(k[0] == r for k in stats)]
    variants = [v for v in VARIANTS if any(k[2] == v for k in stats)]
    fig, axes = plt.subplots(len(regimes), len(variants), figsize=(3 * len(variants), 2.8 * len(regimes)),
                             squeeze=False, sharex=True)
    shown = [s for s in SCHEDULES if any(k[1] == s for k in stats)]
    colors = dict(zip(shown, plt.get_cmap("tab20").colors, strict=False))
    budgets = sorted({k[3] for k in stats})

    def line(ax: Any, regime: str, schedule: str, variant: str, **style: Any) -> None:
        points = sorted((k[3], v[0], v[1]) for k, v in stats.items() if k[:3] == (regime, schedule, variant))
        if points:
            xs, ys, es = zip(*points, strict=True)
            ax.errorbar(xs, ys, yerr=es, marker="o", markersize=3, capsize=2, **style)

    for row, regime in zip(axes, regimes, strict=True):
        for ax, variant in zip(row, variants, strict=True):
            for schedule in shown:
                line(ax, regime, schedule, variant, color=colors[schedule], label=schedule)
            if regime == "same":
                ax.axhline(teacher_top1("same"), color="black", linewidth=1, linestyle="--", label="teacher")
            line(ax, regime, "paper", CEILING, color="black", linestyle="--", label="softmax fine-tuned")
            ax.set_title(f"{variant}, {TITLES[regime].split(' (')[0]}", fontsize=9)
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


def write_report(results: Path = RESULTS, doc: Path = DOC, name: str = "budget",
                 versus: tuple[str, ...] = ("paper",)) -> None:
    """The tables into ``doc`` between the ``name`` markers, the plot beside it (results-budget.png, or
    results-NAME.png for another block); a paired table against each schedule of ``versus``."""
    records = current(read_records(results))
    if not records:
        raise SystemExit(f"no recorded runs in {results}")
    figure = doc.with_name(PLOT.name if name == "budget" else f"results-{name}.png")
    stats = summarise(records)
    plot(stats, figure)
    legend = "\n".join(f"- `{schedule}`: {desc}{_cpu(records, schedule)}" for schedule, (desc, _) in SCHEDULES.items()
                       if any(k[1] == schedule for k in stats))
    minutes = sum(r["seconds"] for r in records) / 60
    block = "\n".join([
        f"<!-- {name}:begin -->",
        f"Final val top-1 (%), mean ± std (runs) per epoch budget; default convert (MLPs copied, attention "
        f"Mimetic), recipe `quickstart` plus the schedule's overrides; {len(records)} runs, {minutes:.0f} min "
        f"of training. Written by `python benchmarks/budget.py{_flags(results, name, versus)}` (the runs: "
        f"benchmarks/results/{results.name}).",
        "", legend, "", markdown_tables(stats), *(verdict_table(records, base) for base in versus),
        f"![val top-1 against epoch budget]({figure.name})", f"<!-- {name}:end -->",
    ])
    text = doc.read_text() if doc.is_file() else "# Results\n"
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in text or end not in text:
        text = text.rstrip() + f"\n\n{begin}\n{end}\n"
    before, rest = text.split(begin, 1)
    doc.write_text(before + block + rest.split(end, 1)[1])
    print(f"wrote {doc} and {figure}")


def _cpu(records: list[dict[str, Any]], schedule: str) -> str:
    """The schedule's mean CPU-seconds per run, where its records carry them (one single-threaded process each)."""
    cpu = [r["cpu_seconds"] for r in records if r["schedule"] == schedule and "cpu_seconds" in r]
    return f" ({statistics.mean(cpu):.1f} CPU-s per run, mean of {len(cpu)})" if cpu else ""


def _flags(results: Path, name: str, versus: tuple[str, ...] = ("paper",)) -> str:
    """The flags that write this block again: none for the default block and file."""
    flags = "" if results.name == RESULTS.name else f" --results benchmarks/results/{results.name}"
    flags += "" if versus == ("paper",) else f" --versus {','.join(versus)}"
    return flags + ("" if name == "budget" else f" --block {name}")


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
    parser.add_argument("--block", default="budget", help="the doc block the tables go into (budget-NAME for another)")
    parser.add_argument("--versus", default="paper", help="paired tables: every candidate against paper, and each "
                        "other schedule X named here against its derivatives X-*")
    args = parser.parse_args()
    schedules, regimes = _list(args.schedules), _list(args.regimes)
    for name, allowed in (("schedule", SCHEDULES), ("regime", (*REGIMES, *TASKS)), ("variant", (*VARIANTS, CEILING))):
        given = {"schedule": schedules + _list(args.versus), "regime": regimes, "variant": _list(args.variants)}[name]
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"error: unknown {name} {', '.join(bad)} (choose from {', '.join(allowed)})")
    if not args.report_only:
        runs = planned(_list(args.variants), schedules, _list(args.epochs, int), _list(args.seeds, int), regimes)
        run_all(runs, args.results, args.jobs)
    write_report(args.results, args.doc, args.block, tuple(_list(args.versus)))


if __name__ == "__main__":
    main()
