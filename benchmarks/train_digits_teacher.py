"""Train the bundled softmax ViT teacher on the bundled digits; writes vitconvert/assets/digits-teacher/.

``python benchmarks/train_digits_teacher.py`` reruns it (fixed seed, about a minute on 2 CPU cores). The
teacher is a timm ``vit_tiny_patch16_224`` shrunk to 16×16 inputs (the 8×8 digits upsampled bilinearly),
4×4 patches, width 64, depth 4, 2 heads and a class token: a real softmax ViT small enough that
``vitconvert quickstart`` distils five linear students from it in minutes. Inputs go through timm's own
eval transform of the saved pretrained_cfg (so every user of the folder sees exactly what it was trained
on); training adds a random affine jitter on the tensors, AdamW and warmup + cosine from timm's factories.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import timm
import torch
from timm.data import create_transform, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torch.nn import functional as F

from vitconvert.assets import TEACHER_DIR
from vitconvert.data import digits_dataset

ARCH = "vit_tiny_patch16_224"
MODEL_ARGS = dict(img_size=16, patch_size=4, embed_dim=64, depth=4, num_heads=2, num_classes=10)
IMG_SIZE = MODEL_ARGS["img_size"]


ALL_CLASSES = tuple(range(10))


def data_cfg(mean: tuple[float, ...], std: tuple[float, ...], classes: tuple[int, ...] = ALL_CLASSES) -> dict:
    """What the folder tells timm (and vitconvert's trainer) about its inputs."""
    return dict(tag="digits", input_size=(3, IMG_SIZE, IMG_SIZE), mean=mean, std=std, crop_pct=1.0,
                interpolation="bilinear", num_classes=len(classes), label_names=[str(i) for i in classes])


def pixel_stats() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of the upsampled training images in [0, 1] (gray, so all channels agree)."""
    plain = create_transform(input_size=(3, IMG_SIZE, IMG_SIZE), crop_pct=1.0, interpolation="bilinear",
                             mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    x = torch.stack([img for img, _ in digits_dataset("train", transform=plain)])
    mean = x.mean(dim=(0, 2, 3))
    std = x.std(dim=(0, 2, 3))
    return tuple(round(float(v), 4) for v in mean), tuple(round(float(v), 4) for v in std)


def tensors(model: torch.nn.Module, split: str,
            classes: tuple[int, ...] = ALL_CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's images of ``classes`` (labels renumbered 0..k-1) through timm's eval transform of the
    model's pretrained_cfg, as one tensor."""
    transform = create_transform(**resolve_data_config(model=model))
    ds = digits_dataset(split, transform=transform)
    keep = [i for i, t in enumerate(ds.targets) if t in classes]
    return torch.stack([ds[i][0] for i in keep]), torch.tensor([classes.index(ds.targets[i]) for i in keep])


def jitter(x: torch.Tensor, background: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random rotation ±12°, scale 0.9-1.1 and shift ±1.5 px per image, padding with the background value."""
    n = x.shape[0]
    angle = (torch.rand(n, generator=generator) * 2 - 1) * 12 * torch.pi / 180
    scale = 0.9 + 0.2 * torch.rand(n, generator=generator)
    shift = (torch.rand(n, 2, generator=generator) * 2 - 1) * (3 / IMG_SIZE)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    shifted = x - background.view(1, -1, 1, 1)
    return F.grid_sample(shifted, grid, align_corners=False) + background.view(1, -1, 1, 1)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return (model(x).argmax(-1) == y).float().mean().item()


def train(epochs: int, batch_size: int, lr: float, seed: int,
          classes: tuple[int, ...] = ALL_CLASSES) -> tuple[torch.nn.Module, float]:
    """A teacher trained on the digits of ``classes`` (all ten by default; a subset for the transfer regime of
    benchmarks/reproduce.py, whose source task is 0-4)."""
    torch.manual_seed(seed)
    mean, std = pixel_stats()
    model = timm.create_model(ARCH, pretrained=False, pretrained_cfg_overlay=data_cfg(mean, std, classes),
                              **{**MODEL_ARGS, "num_classes": len(classes)})
    x_train, y_train = tensors(model, "train", classes)
    x_val, y_val = tensors(model, "val", classes)
    background = (0 - torch.tensor(mean)) / torch.tensor(std)
    steps = (len(y_train) + batch_size - 1) // batch_size
    optimizer = create_optimizer_v2(model, "adamw", lr=lr, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=epochs, warmup_epochs=5, min_lr=1e-5,
                                       warmup_lr=1e-5, step_on_epochs=False, updates_per_epoch=steps)
    generator = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for step in range(steps):
            idx = order[step * batch_size:(step + 1) * batch_size]
            loss = F.cross_entropy(model(jitter(x_train[idx], background, generator)), y_train[idx],
                                   label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step_update(epoch * steps + step + 1)
            total += loss.item()
        if (epoch + 1) % 10 == 0 or epoch == epochs - 1:
            print(f"epoch {epoch + 1:3d}  loss {total / steps:.3f}  val top-1 {accuracy(model, x_val, y_val):.4f}")
    return model.eval(), accuracy(model, x_val, y_val)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TEACHER_DIR)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.perf_counter()
    model, top1 = train(args.epochs, args.batch_size, args.lr, args.seed)
    minutes = (time.perf_counter() - start) / 60
    timm.models.save_for_hf(model, str(args.out), safe_serialization=True)
    (args.out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the package must be world-readable
    (args.out / "training.json").write_text(json.dumps(
        {"script": "benchmarks/train_digits_teacher.py", "arch": ARCH, "model_args": MODEL_ARGS, "epochs": args.epochs,
         "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "val_top1": round(top1, 4),
         "val_images": 297, "minutes": round(minutes, 2), "timm": timm.__version__,
         "torch": torch.__version__.split("+")[0]}, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print(f"val top-1 {top1:.4f}; wrote {args.out} ({size:.2f} MiB) in {minutes:.1f} min")


if __name__ == "__main__":
    main()
