"""Datasets and loaders through timm, with augmentation that is a pure function of (seed, epoch, image index).

Why that matters: a run stopped mid-epoch must resume to bitwise the weights an uninterrupted run gives, so
the data order comes from (seed, epoch) and each image's random augmentation from (seed, epoch, index), never
from RNG state that depends on worker count or how far an iterator got.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import VitconvertError, first_line
from ..recipes import Recipe

TRAIN_SPLITS = ("train", "training")
EVAL_FOLDERS = ("val", "valid", "validation", "eval", "evaluation", "test")
TIMM_PREFIXES = ("torch", "hfds")
# torchvision datasets of the paper's benchmarks that timm's torch/ names lack: class, (train split, eval split).
EXTRA_TORCH: dict[str, tuple[str, str, str]] = {
    "stl10": ("STL10", "train", "test"),
    "food101": ("Food101", "train", "test"),
    "flowers102": ("Flowers102", "train", "test"),
    "pets": ("OxfordIIITPet", "trainval", "test"),
    "oxford_iiit_pet": ("OxfordIIITPet", "trainval", "test"),
}


def is_train_split(split: str) -> bool:
    return split in TRAIN_SPLITS


# -- opening a dataset -----------------------------------------------------------------------------------
def open_dataset(spec: str, split: str, data_dir: Optional[str] = None, download: bool = False) -> Dataset:
    """Untransformed (PIL image, label) pairs of ``split`` from a folder, a timm dataset name or ``digits``."""
    if not spec:
        raise VitconvertError("no data: pass --data FOLDER (with train/ and val/), a timm name "
                              "(torch/cifar100, hfds/...) or digits")
    if spec == "digits":
        from ..assets import digits_dataset

        if not is_train_split(split) and split not in EVAL_FOLDERS:
            raise VitconvertError(f"digits has no {split!r} split: use train or val")
        return digits_dataset("train" if is_train_split(split) else "val")
    prefix, sep, rest = spec.partition("/")
    if sep and prefix.lower() in TIMM_PREFIXES and not Path(spec).exists():
        return open_named(prefix.lower(), rest, spec, split, data_dir, download)
    if sep and prefix.lower() in ("hfids", "tfds", "wds"):
        raise VitconvertError(f"{spec}: streaming datasets are not supported; use hfds/ or an image folder")
    return open_folder(Path(spec).expanduser(), split)


def open_named(prefix: str, name: str, spec: str, split: str, data_dir: Optional[str], download: bool) -> Dataset:
    import timm.data

    root = str(Path(data_dir).expanduser()) if data_dir else None
    if prefix == "torch" and root is None:
        raise VitconvertError(f"{spec} needs --data-dir: the folder that holds (or will hold, with --download) it")
    try:
        if prefix == "torch" and name.lower() in EXTRA_TORCH:
            import torchvision.datasets as tvd

            cls, train, test = EXTRA_TORCH[name.lower()]
            return getattr(tvd, cls)(root, split=train if is_train_split(split) else test, download=download)
        return timm.data.create_dataset(spec, root=root, split=split, download=download)
    except ImportError as e:  # hfds/ needs Hugging Face `datasets`, an optional package
        package = getattr(e, "name", None) or "an optional package"
        raise VitconvertError(f"{spec} needs the Python package {package!r}, which is not installed: pip install "
                              f"{package}") from None
    except (RuntimeError, OSError, FileNotFoundError, ValueError, AssertionError) as e:
        reason = first_line(e)
        hint = "" if download else "; pass --download to fetch it (needs a network)"
        raise VitconvertError(f"cannot open {spec} ({split}) under {root or 'the Hugging Face cache'}: "
                              f"{reason}{hint}") from None


def open_folder(root: Path, split: str) -> Dataset:
    """An image folder root with ``train/`` and ``val/`` (class subfolders inside), read by timm."""
    import timm.data
    from timm.data.readers.img_extensions import get_img_extensions

    if not root.is_dir():
        raise VitconvertError(f"data folder not found: {root} (expected a folder with train/ and val/, a timm "
                              "dataset name like torch/cifar100, or digits)")
    # an evaluation split's synonyms (val/, valid/, ...) stand in for one another; any other name (test, a typo)
    # means exactly that folder, never a silent val/
    names = TRAIN_SPLITS if is_train_split(split) else (split, *EVAL_FOLDERS) if split in EVAL_FOLDERS[:5] else (
        split,)
    folder = next((root / n for n in names if (root / n).is_dir()), None)
    if folder is None:
        have = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise VitconvertError(f"{root} has no {'/'.join(names[:3])}/ folder for the {split} split (it has: "
                              f"{', '.join(have) or 'no folders'})")
    extensions = tuple(get_img_extensions())
    if not any(p.suffix.lower() in extensions for p in folder.rglob("*") if p.is_file()):
        raise VitconvertError(f"{folder} holds no images (class subfolders of {', '.join(extensions[:4])}...)")
    return timm.data.create_dataset("", root=str(folder), split=split, search_split=False)


def dataset_classes(ds: Dataset) -> Optional[int]:
    """How many classes the data has, where the dataset says so."""
    reader = getattr(ds, "reader", None)
    for mapping in (getattr(reader, "class_to_idx", None), getattr(ds, "class_to_idx", None)):
        if mapping:
            return len(mapping)
    classes = getattr(ds, "classes", None)
    if classes:
        return len(classes)
    for attr in ("targets", "labels", "_labels"):
        values = getattr(ds, attr, None)
        if values is not None and len(values):
            return int(max(int(v) for v in values)) + 1
    return None


def check_classes(ds: Dataset, head: int, what: str = "student") -> None:
    found = dataset_classes(ds)
    if found is not None and found != head:
        raise VitconvertError(f"the data has {found} classes but the {what}'s head has {head}: convert the model "
                              f"with `vitconvert convert SOURCE --num-classes {found}` (a new, random head)")


# -- transforms ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputConfig:
    """What the model eats: size, resize interpolation, normalisation, eval crop."""

    img_size: int
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float


def model_input_size(model: nn.Module) -> int:
    """The image side a timm model is built for (its patch embedding's, else its pretrained_cfg's)."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if size:
        return int(size[0] if isinstance(size, (tuple, list)) else size)
    return int(getattr(model, "pretrained_cfg", {}).get("input_size", (3, 224, 224))[-1])


def accepts_size(model: nn.Module, size: int) -> bool:
    embed = getattr(model, "patch_embed", None)
    if embed is None or not getattr(embed, "strict_img_size", False) or getattr(embed, "dynamic_img_size", False):
        return True
    return model_input_size(model) == size


def input_config(model: nn.Module, recipe: Optional[Recipe] = None) -> InputConfig:
    """The recipe's input settings where it sets them, else the model's pretrained_cfg (eval of any model)."""
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    return InputConfig(
        img_size=(recipe.img_size if recipe else None) or model_input_size(model),
        interpolation=recipe.interpolation if recipe else cfg.get("interpolation", "bicubic"),
        mean=tuple((recipe.mean if recipe else None) or cfg.get("mean", (0.485, 0.456, 0.406))),
        std=tuple((recipe.std if recipe else None) or cfg.get("std", (0.229, 0.224, 0.225))),
        crop_pct=float((recipe.crop_pct if recipe else None) or cfg.get("crop_pct", 0.875)),
    )


def train_transform(recipe: Recipe, inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    """timm's training transform for the recipe (posterize made safe for every magnitude: see augment.py)."""
    from timm.data import create_transform

    from .augment import fix_posterize

    transform = create_transform(inp.img_size, is_training=True, no_aug=recipe.no_aug, scale=tuple(recipe.scale),
                                 hflip=recipe.hflip, color_jitter=recipe.color_jitter or 0.0,
                                 auto_augment=recipe.rand_augment, interpolation=inp.interpolation, mean=inp.mean,
                                 std=inp.std, re_prob=recipe.reprob, re_mode=recipe.remode, re_count=recipe.recount)
    return fix_posterize(transform)


def eval_transform(inp: InputConfig) -> Callable[[Any], torch.Tensor]:
    from timm.data import create_transform

    return create_transform(inp.img_size, is_training=False, interpolation=inp.interpolation, mean=inp.mean,
                            std=inp.std, crop_pct=inp.crop_pct)


def mixup_for(recipe: Recipe, num_classes: int) -> Optional[Callable]:
    """timm's Mixup/CutMix (soft targets with label smoothing), or None when both are off."""
    if recipe.mixup <= 0 and recipe.cutmix <= 0:
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=recipe.mixup, cutmix_alpha=recipe.cutmix, prob=recipe.mixup_prob,
                 switch_prob=recipe.mixup_switch_prob, mode=recipe.mixup_mode, label_smoothing=recipe.smoothing,
                 num_classes=num_classes)


# -- reproducible augmentation and order --------------------------------------------------------------
@contextmanager
def sample_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed python, numpy and torch for one image, then restore them: augmentation = f(seed, epoch, index)."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    mixed = (((seed * 1_000_003) + epoch) * 1_000_003 + index) % (2 ** 32)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


class TransformedDataset(Dataset):
    """A base dataset's images through ``transform``; seeded per image when ``seed`` is given (training)."""

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: Optional[int] = None):
        for attr in ("transform", "target_transform"):
            if getattr(base, attr, None) is not None:
                setattr(base, attr, None)  # we apply the transform; the base yields PIL images
        self.base, self.transform, self.seed = base, transform, seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, target = self.base[max(index, 0)]
        target = int(target) if index >= 0 else -1  # -1: padding of an evaluation share
        if getattr(image, "mode", "RGB") != "RGB" and hasattr(image, "convert"):
            image = image.convert("RGB")
        if self.seed is None:
            return self.transform(image), target
        with sample_rng(self.seed, self.epoch, index):
            return self.transform(image), target


class EpochBatchSampler(Sampler[list[int]]):
    """Batches of this rank's share of a (seed, epoch)-shuffled order, from batch ``start`` on: resumable.

    Training drops the tail that does not fill a batch on every rank (as timm does); evaluation keeps every
    image exactly once across ranks (metrics are summed, not averaged).
    """

    def __init__(self, size: int, batch_size: int, seed: int, train: bool, rank: int = 0, world: int = 1):
        self.size, self.batch_size, self.seed, self.train = size, batch_size, seed, train
        self.rank, self.world = rank, world
        self.epoch, self.start = 0, 0

    def batches(self) -> list[list[int]]:
        if self.train:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(
                self.seed * 7919 + self.epoch)).tolist()
            per_rank = self.size // self.world // self.batch_size * self.batch_size
            share = order[self.rank::self.world][:per_rank]
        else:  # every image once; shares padded with -1 (skipped by eval_sums) so all ranks run equal batches
            share = list(range(self.rank, self.size, self.world))
            share += [-1] * (-(-self.size // self.world) - len(share))
        return [share[i:i + self.batch_size] for i in range(0, len(share), self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.start:])

    def __len__(self) -> int:
        return max(len(self.batches()) - self.start, 0)


def default_workers(world: int) -> int:
    return max(0, min(8, (os.cpu_count() or 1) // max(world, 1) - 1))


def ignore_interrupts(loader_pid: int, worker_id: int) -> None:
    """Loader workers ignore Ctrl-C and a scheduler's SIGTERM to the whole process group (the trainer finishes
    its step, saves, then ends them), but still end on a SIGTERM from the process that reads them: torch's own
    worker handler ends on it, and multiprocessing's exit code terminates daemonic children with SIGTERM and
    then joins them, so a worker that ignored it kept a failed run waiting forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # no sender pid to tell them apart (macOS, Windows): torch's handler
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask
    threading.Thread(target=end_on_sigterm_from, args=(loader_pid,), daemon=True, name="vitconvert-sigterm").start()


def end_on_sigterm_from(loader_pid: int) -> None:
    """(The loader's pid, not the parent's: under the forkserver start method the parent is the server.)"""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == loader_pid:
            os._exit(0)  # as torch's worker handler does for its parent's SIGTERM


class ClosingLoader(DataLoader):
    """A DataLoader whose worker processes end when the loop over it ends, also when the loop raises.

    An exception's traceback keeps torch's iterator alive, so its ``__del__`` (which stops the workers) would
    only run at interpreter exit; here the workers are stopped as soon as the loop is left, one way or another.
    """

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()
        try:
            yield from batches
        finally:
            stop = getattr(batches, "_shutdown_workers", None)  # what the iterator's __del__ calls
            if stop is not None:
                stop()


def make_loader(ds: TransformedDataset, batch_size: int, seed: int, train: bool, workers: Optional[int],
                rank: int = 0, world: int = 1, pin_memory: bool = False) -> DataLoader:
    """A loader whose order and augmentation do not depend on the global RNG or on the worker count."""
    sampler = EpochBatchSampler(len(ds), batch_size, seed, train, rank, world)
    workers = default_workers(world) if workers is None else workers
    return ClosingLoader(ds, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                         generator=torch.Generator().manual_seed(seed), persistent_workers=False,
                         worker_init_fn=partial(ignore_interrupts, os.getpid()) if workers else None)


def set_epoch(loader: DataLoader, epoch: int, start: int = 0) -> None:
    """Point the loader at ``epoch``, skipping the first ``start`` batches (a resumed position)."""
    loader.batch_sampler.epoch = epoch  # type: ignore[union-attr]
    loader.batch_sampler.start = start  # type: ignore[union-attr]
    loader.dataset.epoch = epoch  # type: ignore[attr-defined]


@dataclass
class RunData:
    """A distill run's loaders, its validation set (the end-of-run comparison samples it) and epoch arithmetic."""

    train: DataLoader
    val: DataLoader
    val_set: TransformedDataset
    mixup: Optional[Callable]
    labels_checked: bool  # the dataset says its class count; otherwise labels are checked on the first batch
    micro: int  # images per process and forward
    updates_per_epoch: int
    micro_per_epoch: int


def run_data(r: Recipe, inp: InputConfig, num_classes: int, rank: int, world: int, pin_memory: bool) -> RunData:
    """Open both splits and check them against the head and the batch arithmetic before any model runs."""
    train = open_dataset(r.data, r.train_split, r.data_dir, r.download)  # type: ignore[arg-type]
    val = open_dataset(r.data, r.val_split, r.data_dir, r.download)  # type: ignore[arg-type]
    check_classes(train, num_classes)
    if r.batch_size % (world * r.accum_steps):
        raise VitconvertError(f"batch_size {r.batch_size} is not divisible by {world} process(es) × "
                              f"{r.accum_steps} accumulation step(s)")
    micro = r.batch_size // (world * r.accum_steps)
    mixup = mixup_for(r, num_classes)
    if mixup is not None and micro % 2:
        raise VitconvertError(f"mixup/cutmix need an even batch per process and step (got {micro}): change "
                              "batch_size, or set mixup and cutmix to 0")
    updates = len(train) // world // micro // r.accum_steps  # type: ignore[arg-type]
    if updates < 1:
        raise VitconvertError(f"the training split has {len(train)} images: fewer than one optimizer step of "  # type: ignore[arg-type]
                              f"batch_size {r.batch_size}; lower --batch-size")
    train_set = TransformedDataset(train, train_transform(r, inp), seed=r.seed)
    val_set = TransformedDataset(val, eval_transform(inp))
    where = dict(workers=r.workers, rank=rank, world=world, pin_memory=pin_memory)
    return RunData(make_loader(train_set, micro, r.seed, train=True, **where),  # type: ignore[arg-type]
                   make_loader(val_set, micro, r.seed, train=False, **where), val_set, mixup,  # type: ignore[arg-type]
                   dataset_classes(train) is not None, micro, updates, updates * r.accum_steps)
