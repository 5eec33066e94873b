"""What distillation costs per training step, against training the same student alone, in one run.

A distill step = teacher forward (no_grad, hooks keep each attention output) + student forward/backward +
task and attention-output losses + optimizer step; a student-only step = the same without the teacher and
the attention loss. Both run on the same random batch, alternated so that machine load hits both alike;
the medians and their ratio are printed (and written as JSON with --json). On the CPU each step is timed by the
process's CPU time (``--clock cpu``, the default there: other jobs on a shared machine do not inflate it).

    python benchmarks/distill_overhead.py                               # ViT-Tiny/16 at 224 px, ELU, CPU
    python benchmarks/distill_overhead.py --model deit_small_patch16_224 --variant mhla --device cuda
    python benchmarks/distill_overhead.py --batch-size 8 --steps 6 --threads 1 --record   # a row of the table
    python benchmarks/distill_overhead.py --report-only                 # docs/performance.md's table, from the file

``--record`` keeps the row in benchmarks/results/distill-overhead.json (one row per model, variant, attention
target and device; a new measurement replaces the old one) and rewrites the ``distill-overhead`` block of
docs/performance.md from that file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import timm
import torch
from doc_blocks import footer, on_cpus, write_block, write_results

from vitconvert import convert
from vitconvert.capture import DistillStudent, TeacherTap, attention_pairs
from vitconvert.distill.losses import DistillLoss, LossWeights
from vitconvert.recipes import Recipe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "distill-overhead.json"
DOC = ROOT / "docs" / "performance.md"
BLOCK = "distill-overhead"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_tiny_patch16_224", help="timm softmax ViT (built pretrained=False)")
    p.add_argument("--variant", default="elu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attn-target", default="own", choices=("own", "teacher-forced"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--clock", choices=("cpu", "wall"), default=None,
                   help="cpu: the process's CPU time (the default on the CPU); wall: elapsed time (on CUDA)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--record", action="store_true", help=f"keep the row in {RESULTS.relative_to(ROOT)} and "
                                                         f"rewrite the table of {DOC.relative_to(ROOT)}")
    p.add_argument("--report-only", action="store_true", help="only rewrite the table from the results file")
    return p.parse_args()


def record(result: dict[str, Any]) -> None:
    """Keep ``result`` in the results file, in place of an earlier row of the same setting."""
    rows = json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []
    key = ("model", "variant", "attn_target", "device", "batch_size", "img_size")
    rows = [r for r in rows if any(r[k] != result[k] for k in key)] + [result]
    write_results(RESULTS, {"rows": rows})


def render(rows: list[dict[str, Any]]) -> str:
    """docs/performance.md's table: one line per recorded row, then when, where and under what load."""
    clocks = {"cpu": "CPU time", "wall": "wall clock"}
    lines = ["| student | attention target | batch, px | device, threads, clock | student-only step | distill step "
             "| ratio |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} → {r['variant']} | {r['attn_target']} | {r['batch_size']}, {r['img_size']} | "
                     f"{r['device']}, {r['threads']}, {clocks[r['clock']]} | {1000 * r['student_step_s']:.0f} ms | "
                     f"{1000 * r['distill_step_s']:.0f} ms | **{r['ratio']:.2f}×** |")
    runs: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        where = f"{r['date']} at commit {r['commit']} ({r['machine']}, torch {r['torch']})"
        runs.setdefault((where, r["cpus"]), []).append(str(r["loadavg_1min"]))
    measured = [f"Measured {where} " + on_cpus(cpus, None, f"load average {', '.join(loads)} for the rows in order")
                for (where, cpus), loads in runs.items()]
    lines += ["", footer("; ".join(measured) + ": medians of each kind of step, the two kinds alternated",
                         "benchmarks/distill_overhead.py --record", str(RESULTS.relative_to(ROOT)))]
    return "\n".join(lines)


def main() -> None:
    args = parse()
    if args.report_only:
        write_block(DOC, BLOCK, render(json.loads(RESULTS.read_text())["rows"]))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    teacher = timm.create_model(args.model, pretrained=False, img_size=args.img_size, num_classes=100).to(device)
    student, _ = convert(teacher, args.variant)
    student = student.to(device).train()
    mine, theirs = attention_pairs(student, teacher)
    model = DistillStudent(student, mine)
    tap = TeacherTap(teacher, theirs, keep_inputs=args.attn_target == "teacher-forced")
    loss = DistillLoss(Recipe(), mixup_active=False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    targets = torch.randint(0, 100, (args.batch_size,), device=device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                      enabled=False)

    clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    now = time.process_time if clock == "cpu" else time.perf_counter

    def step(distill: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = now()
        with amp:
            t_logits, t_outs, t_in = tap(images) if distill else (None, [], None)
            logits, s_outs = model(images, forced=t_in if args.attn_target == "teacher-forced" else None,
                                   capture=distill)
        weights = LossWeights(1.0, 1.0 if distill else 0.0, 0.0)
        total, _ = loss(weights, logits, targets, s_outs, t_outs, t_logits)
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return now() - start

    for _ in range(args.warmup):
        step(True), step(False)
    distill, alone = [], []
    for _ in range(args.steps):  # alternate, so drifting machine load hits both kinds alike
        distill.append(step(True))
        alone.append(step(False))
    d, a = statistics.median(distill), statistics.median(alone)
    result = {"model": args.model, "variant": args.variant, "batch_size": args.batch_size, "img_size": args.img_size,
              "attn_target": args.attn_target, "device": str(device), "threads": torch.get_num_threads(),
              "distill_step_s": round(d, 4), "student_step_s": round(a, 4), "ratio": round(d / a, 3),
              "clock": clock, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d"), "commit": commit(), "cpus": os.cpu_count(),
              "loadavg_1min": round(os.getloadavg()[0], 1)}
    if args.record:
        record(result)
        write_block(DOC, BLOCK, render(json.loads(RESULTS.read_text())["rows"]))
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model} -> {args.variant}, batch {args.batch_size} at {args.img_size} px on {device} "
          f"({torch.get_num_threads()} threads, {clock} clock), attn target {args.attn_target}")
    print(f"student-only step {a * 1000:.1f} ms, distill step {d * 1000:.1f} ms (medians of {args.steps}): "
          f"distillation costs {d / a:.2f}x a plain training step")


def commit() -> str:
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip()


if __name__ == "__main__":
    main()
