"""Image folders read as a user lays them out: labels from the class folder however deep an image sits, EXIF
orientation applied, every common format, class names compared as Unicode text, and the layouts that would
count or label images wrongly refused in one line (issue 39)."""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, invoke
from PIL import Image
from torchvision.transforms.functional import pil_to_tensor

from vitconvert.data import TransformedDataset, digits_dataset, open_dataset
from vitconvert.data.datasets import ClassOrderWarning
from vitconvert.errors import VitconvertError


def digits_folder(root: Path, per_class: int = 3, name=str, save=None) -> Path:
    """val/ of the bundled digits, class folders named by ``name(label)`` ("0" ... "9": the digits teacher's
    label names), each image written by ``save(image, path)``."""
    data = digits_dataset("val")
    counts: dict[int, int] = {}
    for i in range(len(data)):
        label = data.targets[i]
        if counts.get(label, 0) < per_class:
            folder = root / "val" / name(label)
            folder.mkdir(parents=True, exist_ok=True)
            (save or (lambda im, p: im.save(p)))(data.image(i), folder / f"{i}.png")
            counts[label] = counts.get(label, 0) + 1
    return root


def tiny(root: Path, files: list[str]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (len(rel), 0, 0)).save(root / rel)
    return root


def labels_by_file(ds) -> dict[str, int]:
    return {os.path.relpath(path, ds.reader.root): label for path, label in ds.reader.samples}


def test_an_image_in_a_subfolder_of_a_class_is_that_class(tmp_path):
    """timm's reader labels train/cat/sub/x.png as class "sub"."""
    tiny(tmp_path, ["val/cat/a.png", "val/cat/sub/b.png", "val/cat/sub/deeper/c.png", "val/dog/d.png"])
    ds = open_dataset(str(tmp_path), "val")
    assert ds.reader.class_to_idx == {"cat": 0, "dog": 1}
    assert labels_by_file(ds) == {"cat/a.png": 0, "cat/sub/b.png": 0, "cat/sub/deeper/c.png": 0, "dog/d.png": 1}


def test_class_and_image_order_are_timms_natural_order(tmp_path):
    tiny(tmp_path, ["val/class10/a.png", "val/class2/b.png", "val/class1/c10.png", "val/class1/c9.png"])
    ds = open_dataset(str(tmp_path), "val")
    assert list(ds.reader.class_to_idx) == ["class1", "class2", "class10"]
    assert ds.filenames() == ["class1/c9.png", "class1/c10.png", "class2/b.png", "class10/a.png"]


@pytest.mark.parametrize("suffix", [".tif", ".gif", ".webp", ".bmp", ".JPG"])
def test_common_formats_are_images(tmp_path, suffix):
    for label in ("a", "b"):
        (tmp_path / "val" / label).mkdir(parents=True)
        Image.new("RGB", (4, 4), (9, 9, 9)).save(tmp_path / "val" / label / f"x{suffix}")
    ds = open_dataset(str(tmp_path), "val")
    assert len(ds) == 2 and ds[0][0].size == (4, 4)


def test_a_symlink_loop_is_refused_not_followed(tmp_path):
    digits_folder(tmp_path)
    os.symlink(tmp_path / "val", tmp_path / "val" / "4" / "again")
    assert_one_line_error(invoke("eval", "digits", "--data", tmp_path), "counted more than once")


def test_a_linked_data_folder_is_read_once(tmp_path):
    """A link to a folder elsewhere is an ordinary way to lay out data: followed, each image once."""
    digits_folder(tmp_path / "d")
    elsewhere = tmp_path / "store" / "more"
    tiny(elsewhere, ["x.png", "y.png"])
    os.symlink(elsewhere, tmp_path / "d" / "val" / "4" / "linked")
    ds = open_dataset(str(tmp_path / "d"), "val")
    assert len(ds) == 32 and sum(label == 4 for _, label in ds.reader.samples) == 5


def test_a_loose_image_in_the_split_is_refused(tmp_path):
    digits_folder(tmp_path)
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "stray.png")
    assert_one_line_error(invoke("eval", "digits", "--data", tmp_path), "outside any class folder (stray.png)")


def test_exif_orientation_is_applied(tmp_path):
    """A phone photo held sideways stores the sensor's pixels and an Orientation tag (6: turn 90° clockwise to
    show); read as stored, the digits teacher scores near chance on it."""
    def sideways(image: Image.Image, path: Path) -> None:
        exif = Image.Exif()
        exif[0x0112] = 6
        image.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif)

    upright = digits_dataset("val").image(0)
    sideways(upright, tmp_path / "s.png")
    stored = Image.open(tmp_path / "s.png")
    assert not torch.equal(pil_to_tensor(stored.convert("RGB")), pil_to_tensor(upright.convert("RGB")))

    class One(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i):
            return Image.open(tmp_path / "s.png"), 0

    image, _ = TransformedDataset(One(), pil_to_tensor)[0]
    assert torch.equal(image, pil_to_tensor(upright.convert("RGB")))
    digits_folder(tmp_path / "d", save=sideways)
    result = invoke("eval", "digits", "--data", tmp_path / "d", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["top1"] > 0.9


def test_class_names_compare_as_unicode_text(tmp_path):
    """A folder named in decomposed Unicode (macOS) is the same class as the composed label name."""
    composed = [unicodedata.normalize("NFC", n) for n in ("é", "ü", "ø")]
    for name in composed:
        tiny(tmp_path, [f"val/{unicodedata.normalize('NFD', name)}/x.png"])
    ds = open_dataset(str(tmp_path), "val", classes=list(reversed(composed)), whose="the model's label names")
    assert sorted(ds.reader.samples and {label for _, label in ds.reader.samples}) == [0, 1, 2]
    by_folder = {unicodedata.normalize("NFC", Path(p).parent.name): label for p, label in ds.reader.samples}
    assert by_folder == {name: 2 - i for i, name in enumerate(composed)}


def test_folders_that_share_no_name_with_the_labels_say_how_they_are_labelled(tmp_path):
    """eval's fallback to sorted order is kept (label names may be words), but it is said, on stderr."""
    digits_folder(tmp_path, name=lambda label: f"digit_{label}")
    with pytest.warns(ClassOrderWarning, match="share no name"):
        open_dataset(str(tmp_path), "val", classes=[str(i) for i in range(10)], whose="the model's label names",
                     strict=False)
    result = invoke("eval", "digits", "--data", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    assert "note:" in result.stderr and "digit_0 -> 0" in result.stderr and "digit_0 -> 0" not in result.stdout
    assert json.loads(result.stdout)["top1"] > 0.9


def test_the_split_names_it_looked_for_are_said_once(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(VitconvertError, match=r"no val/valid/validation/ folder"):
        open_dataset(str(tmp_path), "val")
