"""The speed–accuracy frontier of hybrid students: how many softmax layers buy back how much accuracy, at what speed.

    python benchmarks/frontier.py                       # elu and mhla, K = 0..depth, both layer-choice signals
    python benchmarks/frontier.py --report-only         # rewrite docs/results.md from the recorded runs

Accuracy: the bundled digits teacher (4 attention layers) converted with K layers kept softmax (K = 0..4),
the K chosen by ``--keep-softmax auto:K`` (each signal: attn-gap, logit-kl), then distilled with a fixed budget
(the quickstart recipe, 5 epochs, seed 0) and evaluated on the digits val split. K = 4 is the teacher itself.
Speed: DeiT-Tiny (12 layers, random weights: speed does not depend on them) with the same share of layers kept
softmax (K/4 × 12), timed against its softmax source in one process by ``vitconvert bench``'s machinery at 224 and
1024 px, one thread, CPU clock. Records go to benchmarks/results/frontier.jsonl; reruns skip recorded points.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from budget_schedules import BASE  # (batch 64: the recipe every recorded run was made with)
from doc_blocks import write_block

from vitconvert import convert, save
from vitconvert.bench import benchmark
from vitconvert.distill import distill
from vitconvert.evaluate import evaluate
from vitconvert.hybrid import SIGNALS, choose_softmax_layers
from vitconvert.selection import describe
from vitconvert.sources import load_source

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "frontier.jsonl"
DOC = ROOT / "docs" / "results.md"
PLOT = ROOT / "docs" / "results-frontier.png"
OPTIONS: dict[str, dict[str, Any]] = {"mhla": {"blocks_per_side": 2}}  # 2×2 token-level heads on the 4×4 grid
DEPTH, SPEED_ARCH, SPEED_DEPTH, SIZES = 4, "deit_tiny", 12, (224, 1024)
EPOCHS, SEED = 5, 0


def records() -> list[dict[str, Any]]:
    if not RESULTS.is_file():
        return []
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def record(row: dict[str, Any]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def accuracy(variant: str, k: int, signal: str) -> dict[str, Any]:
    """Choose K layers by ``signal``, convert, distil for the fixed budget, evaluate on digits val."""
    teacher = load_source("digits").model
    if k == DEPTH:
        metrics = evaluate(teacher, "digits", device="cpu")
        return {"kind": "accuracy", "variant": variant, "k": k, "signal": signal, "keep": list(range(DEPTH)),
                "top1": metrics["top1"], "seconds": 0.0}
    choice = choose_softmax_layers(teacher, variant, k, "digits", signal=signal, options=OPTIONS.get(variant),
                                   seed=SEED)
    student, _ = convert(teacher, variant, options=OPTIONS.get(variant), seed=SEED, keep_softmax=choice.keep,
                         source="digits")
    work = Path(tempfile.mkdtemp(prefix=f"frontier-{variant}-{k}-"))
    try:
        start = save(student, work / "init", pretrained=True)
        result = distill(start, work / "run", recipe="quickstart", overrides={"epochs": EPOCHS, "seed": SEED, **BASE},
                         show=False, device="cpu")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": "accuracy", "variant": variant, "k": k, "signal": signal, "keep": choice.keep,
            "top1": result.metrics["top1"], "seconds": round(result.seconds, 1)}


def speed(variant: str, k: int) -> dict[str, Any]:
    """Speed-up over softmax of DeiT-Tiny with the same share of layers kept softmax, at each size."""
    kept = round(k / DEPTH * SPEED_DEPTH)
    report = benchmark(SPEED_ARCH, [variant], list(SIZES), pretrained=False, threads=1, repeats=2, warmup=1,
                       memory=False, clock="cpu", options=OPTIONS.get(variant), keep_softmax=list(range(kept)))
    rows = {r.img_size: r.speedup for r in report.rows if r.model == variant}
    return {"kind": "speed", "variant": variant, "k": k, "kept_of_12": kept,
            "speedup": {str(s): round(rows[s], 3) for s in SIZES}}


def run(variants: list[str]) -> None:
    torch.set_num_threads(1)
    done = {(r["kind"], r["variant"], r["k"], r.get("signal")) for r in records()}
    for variant in variants:
        for k in range(DEPTH + 1):
            signals = SIGNALS if 0 < k < DEPTH else SIGNALS[:1]  # K = 0 and K = depth choose nothing
            for signal in signals:
                if ("accuracy", variant, k, signal) not in done:
                    started = time.perf_counter()
                    record({**accuracy(variant, k, signal), "wall": round(time.perf_counter() - started, 1)})
            if k < DEPTH and ("speed", variant, k, None) not in done:
                record(speed(variant, k))


def table(variants: list[str]) -> tuple[str, dict[str, list[tuple[int, float, float]]]]:
    rows = records()
    acc = {(r["variant"], r["k"], r["signal"]): r for r in rows if r["kind"] == "accuracy"}
    spd = {(r["variant"], r["k"]): r["speedup"] for r in rows if r["kind"] == "speed"}
    lines = ["| variant | softmax layers kept (of 4) | kept, by attn-gap | val top-1, attn-gap | kept, by logit-kl | "
             "val top-1, logit-kl | speed-up 224 px | speed-up 1024 px |",
             "|---|---:|---|---:|---|---:|---:|---:|"]
    points: dict[str, list[tuple[int, float, float]]] = {}
    for variant in variants:
        for k in range(DEPTH + 1):
            gap = acc.get((variant, k, "attn-gap"))
            kl = acc.get((variant, k, "logit-kl"))
            if gap is None:
                continue
            speedup = spd.get((variant, k), {"224": 1.0, "1024": 1.0})  # K = depth is the softmax model
            kl_keep = describe(kl["keep"], DEPTH) if kl else "—"
            kl_top1 = f"{100 * kl['top1']:.2f}" if kl else "—"
            lines.append(
                f"| {variant} | {k} | {describe(gap['keep'], DEPTH)} | {100 * gap['top1']:.2f} | {kl_keep} | "
                f"{kl_top1} | {speedup['224']:.2f}× | {speedup['1024']:.2f}× |")
            best = max(gap["top1"], kl["top1"] if kl else 0.0)
            points.setdefault(variant, []).append((k, best, speedup["1024"]))
    return "\n".join(lines), points


def plot(points: dict[str, list[tuple[int, float, float]]]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for variant, pts in points.items():
        ax.plot([p[2] for p in pts], [100 * p[1] for p in pts], marker="o", label=variant)
        for k, top1, speedup in pts:
            ax.annotate(f"K={k}", (speedup, 100 * top1), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("speed-up over softmax at 1024 px (DeiT-Tiny, same share of softmax layers)")
    ax.set_ylabel("digits val top-1 (%), fixed distillation budget")
    ax.set_title("Hybrid students: K softmax layers kept")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def render(variants: list[str]) -> str:
    """The block of docs/results.md, from the recorded runs only."""
    text, points = table(variants)
    if not points:
        raise SystemExit(f"no recorded frontier runs in {RESULTS}")
    return "\n".join([
        f"Digits val top-1 (%) after {EPOCHS} epochs of the quickstart recipe at batch 64 (seed {SEED}; one image = "
        "0.34 points), the K softmax layers chosen by each signal; speed-ups of DeiT-Tiny with the same share of "
        "layers kept softmax, against its softmax source in the same process (1 thread, CPU clock). K = 4 is "
        "the softmax teacher. Written by `python benchmarks/frontier.py`.",
        "",
        text,
        "",
        f"![accuracy against speed-up, one point per K]({PLOT.name})",
    ])


def write_report(variants: list[str]) -> None:
    block = render(variants)
    plot(table(variants)[1])
    write_block(DOC, "frontier", block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="elu,mhla", help="comma-separated variants (default: elu,mhla)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the doc from the recorded runs")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.report_only:
        run(variants)
    write_report(variants)


if __name__ == "__main__":
    main()
