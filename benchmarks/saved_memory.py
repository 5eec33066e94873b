"""Training memory without a GPU: what autograd keeps for backward, per variant against softmax, in one run.

    python benchmarks/saved_memory.py                        # vit_small at 224 px, 2 blocks, batch 2, bf16 autocast
    python benchmarks/saved_memory.py --model deit_tiny_patch16_224 --depth 12 --img-size 384
    python benchmarks/saved_memory.py --json benchmarks/results/saved-memory.json
    python benchmarks/saved_memory.py --depth 1 --batch 1 --img-size 1024 --sizes-only   # 4097 tokens: minutes

The storages autograd saves in one training forward are what a training step holds beyond its weights, and they
are the same on any device: on the CPU the fused kernels run in Triton's interpreter (set here before anything
imports triton), so the GPU path's ops are what is measured. A GPU's peak also holds transient buffers, so the
ratio is a lower bound of the peak's. The second column is the largest transient: the largest tensor one op
writes in a training step (forward and backward, a fused op's body counted inside), the most one step adds at
once to what is held. ``--sizes-only`` counts each Triton launch without running it (its outputs are left
uninitialised): what is kept and written are sizes, the same either way, and 4097 tokens take minutes, not hours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

if __name__ == "__main__" and not torch.cuda.is_available():  # the CPU's kernels: set before timm imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (not when a test imports saved_mib)

import timm  # noqa: E402

import vitconvert  # noqa: E402
from vitconvert.attention import VARIANTS  # noqa: E402
from vitconvert.attention.ops import dispatch  # noqa: E402
from vitconvert.writer import write_text_atomic  # noqa: E402


def saved_mib(model: torch.nn.Module, images: torch.Tensor, run_kernels: bool = True) -> float:
    """MiB of the distinct storages autograd keeps from one bf16-autocast training forward, the model's own
    parameters left out (a layer that keeps a weight itself holds nothing beyond the weights; autocast's bf16
    copies of them count); without ``run_kernels`` the Triton launches are skipped."""
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    launches = nullcontext() if run_kernels else dispatch.launches_through(skipped_launch, images.device.type)
    with launches, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            model(images)
    return sum(storages.values()) / 2**20


class LargestWrite(TorchDispatchMode):
    """The largest storage an op writes (its outputs'; a fused op's body under this mode, its ops one by one)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.largest_op = 0, ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func.namespace == "vitconvert":
            with self:
                out = OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.largest:
                self.largest, self.largest_op = t.untyped_storage().nbytes(), func.name().removeprefix("aten::")
        return out


def unrecorded_launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """A Triton launch outside the recorder: the interpreter's copies to and from its host buffers are not the
    GPU's."""
    with _disable_current_modes():
        return dispatch.build_and_run(kernel, grid, *args, **kwargs)


def skipped_launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """A Triton launch not run (``--sizes-only``): its tensors are allocated by the op all the same."""


def largest_transient(model: torch.nn.Module, images: torch.Tensor, run_kernels: bool = True) -> tuple[float, str]:
    """MiB of the largest tensor one op writes in a bf16-autocast training step (forward and backward), and the
    op that writes it first."""
    model.zero_grad(set_to_none=True)
    recorder = LargestWrite()
    launch = unrecorded_launch if run_kernels else skipped_launch
    with dispatch.launches_through(launch, images.device.type), recorder:
        with torch.autocast(images.device.type, dtype=torch.bfloat16):
            logits = model(images)
        logits.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return recorder.largest / 2**20, recorder.largest_op


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224", help="timm name (random init)")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--depth", type=int, default=2, help="blocks (the ratio does not depend on it much)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="also write the table to this JSON file")
    parser.add_argument("--programs", type=int, help="programs a launch wants before heads split over token ranges, "
                        "as on a GPU (4 an SM: 528 on an H100 or H200); default the CPU's 1, no split")
    parser.add_argument("--sizes-only", action="store_true",
                        help="count each Triton launch without running it in the interpreter (sizes are what counts)")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"error: unknown variant {unknown[0]!r}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with dispatch.kernels_on("cpu" if device.type == "cpu" else None,  # the kernels' path, in Triton's interpreter
                             programs=args.programs):
        table = measure(args, variants, device)
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(table, indent=1) + "\n")
    return 0


def measure(args: argparse.Namespace, variants: list[str], device: torch.device) -> dict[str, Any]:
    """Prints and returns {variant: (saved MiB, largest transient MiB)} against softmax's, with the setting."""
    torch.manual_seed(0)
    source = timm.create_model(args.model, pretrained=False, img_size=args.img_size, depth=args.depth).to(device)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    models = {"softmax": source, **{name: vitconvert.convert(source, name)[0] for name in variants}}
    run, table = not args.sizes_only, {}
    for name, model in models.items():
        largest, op = largest_transient(model, images, run)
        table[name] = {"saved_mib": saved_mib(model, images, run), "largest_transient_mib": largest,
                       "largest_transient_op": op}
    print(f"{args.model} at {args.img_size} px, {args.depth} blocks, batch {args.batch}, bf16 autocast on {device}: "
          "saved for backward, and the largest tensor one op writes in a training step")
    softmax = table["softmax"]
    for name, row in table.items():
        print(f"  {name:8s} {row['saved_mib']:8.1f} MiB  {row['saved_mib'] / softmax['saved_mib']:.2f}× softmax   "
              f"largest {row['largest_transient_mib']:7.2f} MiB  "
              f"{row['largest_transient_mib'] / softmax['largest_transient_mib']:.2f}× softmax "
              f"({row['largest_transient_op']})")
    tokens = source.patch_embed.num_patches + source.num_prefix_tokens
    return {"model": args.model, "img_size": args.img_size, "tokens": tokens, "depth": args.depth,
            "batch": args.batch, "device": str(device), "sizes_only": args.sizes_only,
            **({"programs": args.programs} if args.programs else {}), "variants": table}


if __name__ == "__main__":
    sys.exit(main())
