"""Where a whole converted model's time goes: torch.profiler over the softmax source and each variant, one step.

    python benchmarks/profile_model.py                           # deit_small, 224 px, batch 256, bf16, inference
    python benchmarks/profile_model.py --img-size 1024 --batch 16 --train
    python benchmarks/profile_model.py --device cpu --model vit_tiny_patch16_224 --batch 2 --rows 5   # a dry run

profile_mix.py times the token mixing alone; at ViT sizes a variant can lose to softmax outside it (LePE, norms,
layout changes, launches), and only a whole-model profile shows that. For each model: the wall time per step in
the same run as softmax (speed-up = softmax / model), then the ops by self time on the device — ops whose CPU
time exceeds their device time are bound by launches and Python, not by the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Optional

import timm
import torch
from torch.profiler import ProfilerActivity, profile

import vitconvert
from vitconvert.attention import VARIANTS


def build(name: str, variant: str, img_size: int, device: torch.device) -> torch.nn.Module:
    """The random-init source (``variant == "softmax"``) or its conversion (Mimetic attention, copied rest)."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=img_size)
    if variant != "softmax":
        model, _ = vitconvert.convert(model, variant)
    return model.to(device)


def make_step(model: torch.nn.Module, images: torch.Tensor, train: bool, amp: Optional[torch.dtype]) -> Callable:
    model.train(train)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with torch.autocast(images.device.type, dtype=amp, enabled=amp is not None), torch.set_grad_enabled(train):
            out = model(images)
        if train:
            grads = torch.autograd.grad(out.float().sum(), params)
            del grads

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_step(step: Callable, device: torch.device, calls: int) -> float:
    """Milliseconds per step, after warm-up (the first calls build kernels and autotune)."""
    for _ in range(3):
        step()
    sync(device)
    began = time.perf_counter()
    for _ in range(calls):
        step()
    sync(device)
    return (time.perf_counter() - began) / calls * 1e3


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deit_small_patch16_224", help="timm name (random init)")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--train", action="store_true", help="forward + backward (default: inference)")
    parser.add_argument("--variants", default=",".join(["softmax", *VARIANTS]))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=10, help="steps timed and profiled per model")
    parser.add_argument("--rows", type=int, default=15, help="rows of each profile table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU (a dry run: --device cpu)", file=sys.stderr)
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v != "softmax" and v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}; valid: softmax, {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    amp = torch.bfloat16 if device.type == "cuda" else None
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    mode = "forward+backward" if args.train else "forward"
    print(f"{args.model} at {args.img_size} px, batch {args.batch}, {mode}, "
          f"{'bf16 autocast' if amp else 'float32'} on {device}")
    softmax_ms = None
    for variant in variants:
        step = make_step(build(args.model, variant, args.img_size, device), images, args.train, amp)
        ms = time_step(step, device, args.calls)
        softmax_ms = ms if variant == "softmax" else softmax_ms
        ratio = f" ({softmax_ms / ms:.2f}× softmax)" if softmax_ms is not None and variant != "softmax" else ""
        with profile(activities=activities) as prof:
            for _ in range(args.calls):
                step()
            sync(device)
        print(f"\n{variant}: {ms:.2f} ms/step (wall, unprofiled){ratio}; profile of {args.calls} steps:")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
