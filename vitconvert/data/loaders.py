"""Loaders whose order and augmentation are a pure function of (seed, epoch, image index).

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
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ..errors import VitconvertError, param, plural
from ..recipes import Recipe
from .batched import Unsupported, batch_transform
from .datasets import check_classes, class_names, dataset_classes, open_dataset
from .image_folder import upright
from .transforms import InputConfig, eval_transform, mixup_for, train_transform


# -- reproducible augmentation and order --------------------------------------------------------------
def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one image's augmentation in one epoch (its random streams: sample_rng, batched.SampleDraws)."""
    return (((seed * 1_000_003) + epoch) * 1_000_003 + index) % (2 ** 32)


@contextmanager
def sample_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed python, numpy and torch's CPU generator for one image, then restore them: augmentation = f(seed,
    epoch, index). Only the CPU generator, which transforms draw from: ``torch.manual_seed`` also queues a seed
    for every accelerator torch was built for, formatting the call stack each time on a machine without one,
    which was half the CPU time of a quickstart training."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    mixed = sample_seed(seed, epoch, index)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.default_generator.manual_seed(mixed)  # what torch.manual_seed does to the CPU stream
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


def to_rgb(image: Any) -> Any:
    """A PIL image as 8-bit RGB. 16- and 32-bit grey (a 16-bit PNG opens as "I;16" or "I") is scaled to 8 bits:
    PIL's own convert clips it at 255, which turns a 16-bit photograph into an almost black-and-white one."""
    if image.mode.startswith("I"):
        import numpy as np
        from PIL import Image

        values = np.asarray(image, dtype=np.float64)
        if values.max(initial=0) > 255:
            values = values / 257.0  # 65535 -> 255
        return Image.fromarray(np.clip(values + 0.5, 0, 255).astype(np.uint8), "L").convert("RGB")
    return image.convert("RGB")


def uint8_source(base: Dataset) -> Optional[Callable[[list[int]], tuple[np.ndarray, list[int]]]]:
    """``base.uint8_images`` (images held as arrays: the digits), also through a Subset of such a base."""
    if isinstance(base, Subset):
        inner = uint8_source(base.dataset)
        return None if inner is None else (lambda indices: inner([base.indices[i] for i in indices]))  # type: ignore
    found = getattr(base, "uint8_images", None)
    return found if callable(found) else None


class TransformedDataset(Dataset):
    """A base dataset's images through ``transform``; seeded per image when ``seed`` is given (training).

    A base that holds its images as uint8 arrays (``uint8_images``: the digits) is transformed a batch at a time
    where the transform has a batch form (batched.py): the same images, without a PIL round trip per image."""

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: Optional[int] = None):
        for attr in ("transform", "target_transform"):
            if getattr(base, attr, None) is not None:
                setattr(base, attr, None)  # we apply the transform; the base yields PIL images
        self.base, self.transform, self.seed = base, transform, seed
        self.epoch = 0
        self.arrays = uint8_source(base)
        self.batched = batch_transform(transform) if self.arrays is not None else None

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, target = self.base[max(index, 0)]
        target = int(target) if index >= 0 else -1  # -1: padding of an evaluation share
        image = upright(image)
        if getattr(image, "mode", "RGB") != "RGB" and hasattr(image, "convert"):
            image = to_rgb(image)
        if self.seed is None:
            return self.transform(image), target
        with sample_rng(self.seed, self.epoch, index):
            return self.transform(image), target

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """A batch (what DataLoader asks for): transformed at once where it can be, else image by image."""
        if self.batched is not None:
            try:
                return self._batch(indices)
            except Unsupported:
                self.batched = None  # an image this batch form cannot take: the per-image path from now on
        return [self[i] for i in indices]

    def _batch(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        images, targets = self.arrays([max(i, 0) for i in indices])  # type: ignore[misc]
        seeds = None if self.seed is None else [sample_seed(self.seed, self.epoch, i) for i in indices]
        batch = self.batched(images, seeds)  # type: ignore[misc]
        return [(image, int(t) if i >= 0 else -1) for image, t, i in zip(batch, targets, indices, strict=True)]


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
        """This rank's batches of the epoch: a seeded order (training) or every image once (eval)."""
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
    """Loader processes per rank: the cores left after the trainer's own, at most 8."""
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
    class_names: Optional[list[str]]  # the train split's, in label order, when it names its classes
    micro: int  # images per process and forward
    updates_per_epoch: int
    micro_per_epoch: int


def run_data(r: Recipe, inp: InputConfig, num_classes: int, rank: int, world: int, pin_memory: bool) -> RunData:
    """Open both splits and check them against the head and the batch arithmetic before any model runs."""
    d, o = r.dataset, r.optimization
    train = open_dataset(d.data, d.train_split, d.data_dir, d.download)  # type: ignore[arg-type]
    check_classes(train, num_classes)
    names = class_names(train)
    val = open_dataset(d.data, d.val_split, d.data_dir, d.download,  # type: ignore[arg-type]
                       classes=names, whose=f"the {d.train_split} split's classes")  # labels by name
    if o.batch_size % (world * o.accum_steps):
        raise VitconvertError(f"batch_size {o.batch_size} is not divisible by {world} process(es) × "
                              f"{o.accum_steps} accumulation step(s)")
    micro = o.batch_size // (world * o.accum_steps)
    mixup = mixup_for(r, num_classes)
    if mixup is not None and micro % 2:
        raise VitconvertError(f"mixup/cutmix need an even batch per process and step (got {micro}): change "
                              "batch_size, or set mixup and cutmix to 0")
    images = len(train)  # type: ignore[arg-type]
    updates = images // world // micro // o.accum_steps
    if updates < 1:
        raise VitconvertError(f"the training split has {plural(images, 'image')}: fewer than one optimizer step of "
                              f"batch_size {o.batch_size}; lower {param('batch_size')}")
    train_set = TransformedDataset(train, train_transform(r, inp), seed=r.seed)
    val_set = TransformedDataset(val, eval_transform(inp))
    where = dict(workers=d.workers, rank=rank, world=world, pin_memory=pin_memory)
    return RunData(make_loader(train_set, micro, r.seed, train=True, **where),  # type: ignore[arg-type]
                   make_loader(val_set, micro, r.seed, train=False, **where), val_set, mixup,  # type: ignore[arg-type]
                   dataset_classes(train) is not None, names, micro, updates, updates * o.accum_steps)
