"""What distillation costs per training step, against training the same student alone, in one run.

A distill step = teacher forward (no_grad, hooks keep each attention output) + student forward/backward +
task and attention-output losses + optimizer step; a student-only step = the same without the teacher and
the attention loss. Both run on the same random batch, alternated so that machine load hits both alike;
the medians and their ratio are printed (and written as JSON with --json).

    python benchmarks/distill_overhead.py                               # ViT-Tiny/16 at 224 px, ELU, CPU
    python benchmarks/distill_overhead.py --model deit_small_patch16_224 --variant mhla --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import timm
import torch

from vitconvert import convert
from vitconvert.capture import DistillStudent, TeacherTap, attention_pairs
from vitconvert.distill.losses import DistillLoss, LossWeights
from vitconvert.recipes import Recipe


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
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
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

    def step(distill: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
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
        return time.perf_counter() - start

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
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model} -> {args.variant}, batch {args.batch_size} at {args.img_size} px on {device} "
          f"({torch.get_num_threads()} threads), attn target {args.attn_target}")
    print(f"student-only step {a * 1000:.1f} ms, distill step {d * 1000:.1f} ms (medians of {args.steps}): "
          f"distillation costs {d / a:.2f}x a plain training step")


if __name__ == "__main__":
    main()
