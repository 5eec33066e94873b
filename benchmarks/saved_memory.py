"""Training memory without a GPU: what autograd keeps for backward, per variant against softmax, in one run.

    python benchmarks/saved_memory.py                        # vit_small at 224 px, 2 blocks, batch 2, bf16 autocast
    python benchmarks/saved_memory.py --model deit_tiny_patch16_224 --depth 12 --img-size 384

The storages autograd saves in one training forward are what a training step holds beyond its weights, and they
are the same on any device: on the CPU the fused kernels run in Triton's interpreter (set here before anything
imports triton), so the GPU path's ops are what is measured. A GPU's peak also holds transient buffers, so the
ratio is a lower bound of the peak's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # the CPU's kernels: set before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (not when a test imports saved_mib)

import timm  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention import VARIANTS, dispatch  # noqa: E402


def saved_mib(model: torch.nn.Module, images: torch.Tensor) -> float:
    """MiB of the distinct storages autograd keeps from one bf16-autocast training forward, the model's own
    parameters left out (a layer that keeps a weight itself holds nothing beyond the weights; autocast's bf16
    copies of them count)."""
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            model(images)
    return sum(storages.values()) / 2**20


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm name (random init)")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--depth", type=int, default=2, help="blocks (the ratio does not depend on it much)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with dispatch.kernels_on("cpu" if device.type == "cpu" else None):  # the kernels' path, in Triton's interpreter
        measure(args, variants, device)
    return 0


def measure(args: argparse.Namespace, variants: list[str], device: torch.device) -> None:
    torch.manual_seed(0)
    source = timm.create_model(args.model, pretrained=False, img_size=args.img_size, depth=args.depth).to(device)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    softmax = saved_mib(source, images)
    print(f"{args.model} at {args.img_size} px, {args.depth} blocks, batch {args.batch}, bf16 autocast on {device}: "
          "saved for backward")
    print(f"  softmax  {softmax:8.1f} MiB")
    for name in variants:
        student, _ = vitconvert.convert(source, name)
        mib = saved_mib(student, images)
        print(f"  {name:8s} {mib:8.1f} MiB  {mib / softmax:.2f}× softmax")


if __name__ == "__main__":
    sys.exit(main())
