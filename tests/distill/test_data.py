"""Data: folders and names through timm, reproducible order and augmentation, one-line errors."""

from __future__ import annotations

import pytest
import timm
import torch

from vitconvert.data import (
    EpochBatchSampler,
    TransformedDataset,
    check_classes,
    input_config,
    open_dataset,
    teacher_normalizer,
    train_transform,
)
from vitconvert.errors import VitconvertError
from vitconvert.recipes import build_recipe

from .helpers import make_images


def test_train_shares_are_disjoint_equal_and_resumable():
    shares = [EpochBatchSampler(23, 3, seed=1, train=True, rank=r, world=2) for r in range(2)]
    batches = [s.batches() for s in shares]
    flat = [i for b in batches for batch in b for i in batch]
    assert len(flat) == len(set(flat)) == 18 and all(len(b) == 3 for b in batches)  # 23 // 2 // 3 * 3 per rank
    shares[0].start = 2
    assert list(shares[0]) == batches[0][2:] and len(shares[0]) == 1
    shares[0].epoch = 1
    assert shares[0].batches() != batches[0]  # a new order each epoch


def test_eval_shares_cover_every_image_once_with_padding():
    shares = [EpochBatchSampler(5, 2, seed=0, train=False, rank=r, world=2).batches() for r in range(2)]
    assert [len(b) for b in shares] == [2, 2]
    flat = sorted(i for b in shares for batch in b for i in batch)
    assert flat == [-1, 0, 1, 2, 3, 4]


def test_augmentation_is_a_function_of_seed_epoch_and_index(images):
    base = open_dataset(str(images), "train")
    recipe = build_recipe(dict(img_size=32, rand_augment="rand-m9-mstd0.5-inc1", reprob=0.25))
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              num_heads=2, depth=1)
    ds = TransformedDataset(base, train_transform(recipe, input_config(model, recipe)), seed=7)
    first = ds[3][0]
    ds[5]  # neither what was loaded before
    torch.manual_seed(123)  # nor the global RNG matters
    assert torch.equal(ds[3][0], first)
    ds.epoch = 1
    assert not torch.equal(ds[3][0], first)
    state = torch.get_rng_state()
    ds[0]
    assert torch.equal(state, torch.get_rng_state())  # and is left untouched


def test_folder_errors(tmp_path):
    with pytest.raises(VitconvertError, match="data folder not found"):
        open_dataset(str(tmp_path / "missing"), "train")
    (tmp_path / "empty" / "train" / "a").mkdir(parents=True)
    with pytest.raises(VitconvertError, match="holds no images"):
        open_dataset(str(tmp_path / "empty"), "train")
    make_images(tmp_path / "noval", val_per_class=0)
    (tmp_path / "noval" / "val").rename(tmp_path / "noval" / "other")
    with pytest.raises(VitconvertError, match="has no validation/val/valid/ folder"):
        open_dataset(str(tmp_path / "noval"), "validation")
    with pytest.raises(VitconvertError, match="needs data_dir"):
        open_dataset("torch/cifar10", "train")
    with pytest.raises(VitconvertError, match="pass download=True"):
        open_dataset("torch/cifar10", "train", data_dir=str(tmp_path))


def test_class_count_must_match_the_head(images):
    ds = open_dataset(str(images), "validation")
    assert len(ds) == 6
    check_classes(ds, 3)
    with pytest.raises(VitconvertError, match="3 classes but the student's head has 10.*num_classes=3"):
        check_classes(ds, 10)


def test_digits_come_from_the_bundled_assets():
    pytest.importorskip("vitconvert.assets")
    train, val = open_dataset("digits", "train"), open_dataset("digits", "validation")
    assert len(train) == 1500 and len(val) == 297
    image, label = train[0]
    assert image.mode == "RGB" and 0 <= label < 10


def test_teacher_gets_its_own_normalisation():
    teacher = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                num_heads=2, depth=1)
    teacher.pretrained_cfg = {**teacher.pretrained_cfg, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    inp = input_config(teacher, build_recipe(dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))))
    renorm = teacher_normalizer(inp, teacher, torch.device("cpu"))
    pixels = torch.rand(2, 3, 4, 4)
    student_view = (pixels - torch.tensor(inp.mean).view(1, 3, 1, 1)) / torch.tensor(inp.std).view(1, 3, 1, 1)
    assert torch.allclose(renorm(student_view), (pixels - 0.5) / 0.5, atol=1e-6)
    same = input_config(teacher, build_recipe(dict(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))))
    assert teacher_normalizer(same, teacher, torch.device("cpu")) is None


def child_processes() -> set[int]:
    import os
    from pathlib import Path

    found = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            found |= {int(p) for p in (task / "children").read_text().split()}
        except FileNotFoundError:  # a thread that ended between the listing and the read
            continue
    return found


class Broken(TransformedDataset):
    def __getitem__(self, index):
        if index == 5:
            raise RuntimeError("item 5 cannot be read")
        return super().__getitem__(index)


@pytest.mark.parametrize("where", ["worker", "loop"])
def test_loader_workers_end_with_the_loop_even_when_it_raises(images, where):
    """Not at interpreter exit: the exception's traceback keeps torch's iterator (whose __del__ would stop them)."""
    from torchvision.transforms.functional import pil_to_tensor

    from vitconvert.data import make_loader

    before = child_processes()
    loader = make_loader(Broken(open_dataset(str(images), "train"), pil_to_tensor), 2, 0, train=False, workers=2)
    with pytest.raises(RuntimeError, match="item 5 cannot be read" if where == "worker" else "the teacher failed"):
        for _ in loader:
            assert len(child_processes() - before) == 2
            if where == "loop":
                raise RuntimeError("the teacher failed")
    assert child_processes() - before == set()


def test_an_images_seed_touches_the_cpu_generator_alone(monkeypatch):
    """The same CPU stream torch.manual_seed would give, without seeding every accelerator torch was built for:
    on a CUDA build without a GPU that queued a lazy seed and formatted the call stack per image (a third of a
    quickstart training's CPU time)."""
    import torch

    from vitconvert.data import sample_rng

    def refuse(*args, **kwargs):
        raise AssertionError("an accelerator was seeded for one image's augmentation")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", refuse)
    monkeypatch.setattr(torch, "manual_seed", refuse)
    mixed = (((3 * 1_000_003) + 1) * 1_000_003 + 7) % (2 ** 32)
    with sample_rng(3, 1, 7):
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(mixed)))
