"""Why a converted TTT student stayed at chance in transfer: one run with one factor changed, or the init probe.

The transfer regime of benchmarks/reproduce.py (source teacher pretrained on digits 0-4, students re-headed and
trained on digits 5-9 for 5 epochs with the quickstart recipe), TTT only, one seed, one configuration: each flag
changes one factor against the default conversion (MLPs, embeddings, norms copied, attention Mimetic).

    python benchmarks/ttt_transfer.py --inner-lr 1                 # the reference's step size: chance
    python benchmarks/ttt_transfer.py --inner-lr 1 --distill       # the same, distilled
    python benchmarks/ttt_transfer.py                              # the default step size
    python benchmarks/ttt_transfer.py --inner-lr 1 --fast-std 0.1  # larger fast weights instead
    python benchmarks/ttt_transfer.py --probe --inner-lr 1         # per layer: attention output / input, class token

Prints the final val top-1, the per-epoch curve and the first and last logged loss terms (``RESULT ...``); with
``--probe``, no training: each layer's attention output RMS over its input RMS and how much the class token's
final feature varies across 64 target images (the softmax teacher's for comparison).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from budget_schedules import BASE  # noqa: E402  (batch 64: the recipe every recorded run was made with)
from reproduce import TARGET_CLASSES, prepare_transfer  # noqa: E402


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn-init", default="mimetic", choices=("mimetic", "copy", "random"))
    p.add_argument("--distill", action="store_true", help="add the attention-output MSE (weight 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--inner-lr", type=float, default=None, help="TTT's inner step size (default: the variant's)")
    p.add_argument("--key-eps", type=float, default=None, help="eps of the keys' instance norm (default 1.0)")
    p.add_argument("--fast-std", type=float, default=None, help="re-draw the fast weights at this std (init 0.02)")
    p.add_argument("--lr-scale-new", type=float, default=None, help="recipe new_params.lr_scale")
    p.add_argument("--clip-grad", type=float, default=None, help="recipe clip_grad (0: off; quickstart: 1.0)")
    p.add_argument("--same-task", action="store_true", help="the bundled digits teacher on its own task instead")
    p.add_argument("--probe", action="store_true", help="print the init probe instead of training")
    return p.parse_args(argv)


def converted(args: argparse.Namespace, source: str) -> torch.nn.Module:
    from vitconvert import convert
    from vitconvert.sources import load_source

    options = {k: v for k, v in (("inner_lr", args.inner_lr), ("key_norm_eps", args.key_eps)) if v is not None}
    heads = None if args.same_task else len(TARGET_CLASSES)
    student, _ = convert(load_source(source).model, to="ttt", attn_init=args.attn_init, seed=args.seed,
                         options=options or None, source=source, num_classes=heads)
    if args.fast_std is not None:
        generator = torch.Generator().manual_seed(1000 + args.seed)
        with torch.no_grad():
            for module in student.modules():
                for name in ("fast_w1", "fast_w2", "fast_w3"):
                    if hasattr(module, name):
                        weight = getattr(module, name)
                        weight.copy_(torch.randn(weight.shape, generator=generator).clamp(-2, 2) * args.fast_std)
    return student


def train(args: argparse.Namespace, student: torch.nn.Module, target: Optional[Path]) -> str:
    from vitconvert import save
    from vitconvert.distill import distill

    overrides: dict[str, Any] = {"epochs": args.epochs, "seed": args.seed, **BASE,
                                 "attn_weight": 1.0 if args.distill else 0.0, "kd_weight": 0.0, "log_interval": 1,
                                 "compare_batches": 0}
    if target is not None:  # else the quickstart recipe's own data: the digits, all ten classes
        overrides.update({"data": str(target), "img_size": None})
    if args.clip_grad is not None:
        overrides["clip_grad"] = args.clip_grad or None
    if args.lr_scale_new is not None:
        overrides["new_params"] = {"lr_scale": args.lr_scale_new}
    work = Path(tempfile.mkdtemp(prefix="ttt-transfer-"))
    try:
        result = distill(save(student, work / "init", pretrained=True), work / "run", recipe="quickstart",
                         overrides=overrides, show=False, device="cpu")
        records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]

    def terms(r: dict[str, Any]) -> str:
        return " ".join(f"{k}={r[k]:.3g}" for k in ("task", "attn") if k in r)

    curve = " ".join(f"{100 * r['val_top1']:.1f}" for r in epochs)
    return (f"RESULT top1={100 * result.metrics['top1']:.1f} val/epoch=[{curve}] first[{terms(steps[0])}] "
            f"last[{terms(steps[-1])}] {result.seconds:.0f}s")


def target_batch(model: torch.nn.Module, count: int = 64) -> torch.Tensor:
    """The first ``count`` digits 5-9 of the val split, as the model's normalised 16×16 input."""
    from torchvision.transforms.functional import resize, to_tensor

    from vitconvert.data import digits_dataset

    ds = digits_dataset("val")
    picked = [i for i, t in enumerate(ds.targets) if t in TARGET_CLASSES][:count]
    images = torch.stack([to_tensor(resize(ds.image(i).convert("RGB"), [16, 16])) for i in picked])
    cfg = model.pretrained_cfg
    return (images - torch.tensor(cfg["mean"]).view(1, 3, 1, 1)) / torch.tensor(cfg["std"]).view(1, 3, 1, 1)


def probe(model: torch.nn.Module, x: torch.Tensor, name: str) -> None:
    """Attention output RMS / input RMS per layer (class token, patches) and the class token's spread."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.attn.register_forward_hook(lambda m, i, o: seen.append((i[0], o)) and None) for b in model.blocks]
    with torch.no_grad():
        cls = model.eval().forward_features(x)[:, 0]
    for h in hooks:
        h.remove()

    def rms(t: torch.Tensor) -> float:
        return t.pow(2).mean().sqrt().item()

    print(f"{name}: class-token feature spread across images (std / mean |x|) "
          f"{(cls.std(0).mean() / cls.abs().mean()).item():.2e}")
    for layer, (inp, out) in enumerate(seen):
        print(f"    layer {layer}: attention out/in RMS, class token {rms(out[:, 0]) / rms(inp[:, 0]):.2e}, "
              f"patches {rms(out[:, 1:]) / rms(inp[:, 1:]):.2e}")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    source, target = prepare_transfer()
    spec = "digits" if args.same_task else str(source)
    student = converted(args, spec)
    if args.probe:
        from vitconvert.sources import load_source

        teacher = load_source(spec).model
        x = target_batch(teacher)
        probe(teacher, x, "softmax source teacher")
        lr = next(m.inner_lr for m in student.modules() if hasattr(m, "inner_lr"))
        std = args.fast_std if args.fast_std is not None else 0.02
        probe(student, x, f"ttt, attention {args.attn_init}, inner_lr {lr:g}, fast weights std {std:g}")
        return
    print(train(args, student, None if args.same_task else target), flush=True)


if __name__ == "__main__":
    main()
