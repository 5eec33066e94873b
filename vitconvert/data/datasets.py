"""Opening a dataset: an image folder, a timm/torchvision name or the bundled digits, as (PIL image, label)."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Optional
from urllib.error import URLError

from torch.utils.data import Dataset

from ..errors import VitconvertError, first_line, param, plural
from .digits import digits_dataset
from .image_folder import IMAGE_EXTENSIONS, ClassFolderReader, as_dataset, same_name

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



class ClassOrderWarning(UserWarning):
    """An image folder labelled by its sorted order because its names match none of the model's."""


def is_train_split(split: str) -> bool:
    """Whether a split name means training data (train, training): it picks torchvision's train set and the
    folders an image folder's split is looked for in."""
    return split in TRAIN_SPLITS


# -- opening a dataset -----------------------------------------------------------------------------------
def open_dataset(spec: str, split: str, data_dir: Optional[str] = None, download: bool = False,
                 classes: Optional[Sequence[str]] = None, whose: str = "", strict: bool = True) -> Dataset:
    """Untransformed (PIL image, label) pairs of ``split`` from a folder, a timm dataset name or ``digits``.

    ``classes`` (the train split's class folders, a model's label names) gives an image folder's labels by
    name instead of by position (``align_classes``); ``whose`` says where they come from, for its errors;
    ``strict=False`` lets a folder whose names share none with ``classes`` keep its own order."""
    if not spec:
        raise VitconvertError(f"no data: pass {param('data', 'FOLDER')} (with train/ and val/), a timm name "
                              "(torch/cifar100, hfds/...) or digits")
    if spec == "digits":
        if not is_train_split(split) and split not in EVAL_FOLDERS:
            raise VitconvertError(f"digits has no {split!r} split: use train or val")
        return digits_dataset("train" if is_train_split(split) else "val")
    prefix, sep, rest = spec.partition("/")
    if sep and prefix.lower() in TIMM_PREFIXES and not Path(spec).exists():
        return open_named(prefix.lower(), rest, spec, split, data_dir, download)
    if sep and prefix.lower() in ("hfids", "tfds", "wds"):
        raise VitconvertError(f"{spec}: streaming datasets are not supported; use hfds/ or an image folder")
    return open_folder(Path(spec).expanduser(), split, classes, whose, strict)


def open_named(prefix: str, name: str, spec: str, split: str, data_dir: Optional[str], download: bool) -> Dataset:
    """A dataset timm or torchvision names (``torch/cifar100``), whose failed download leaves no folder behind."""
    root = str(Path(data_dir).expanduser()) if data_dir else None
    if prefix == "torch" and root is None:
        raise VitconvertError(f"{spec} needs {param('data_dir')}: the folder that holds (or will hold, with "
                              f"{param('download', True)}) it")
    # the folders a failed download would leave behind: those of root that do not exist yet, outermost first
    created = [] if root is None else [p for p in (Path(root), *Path(root).parents) if not p.exists()][-1:]
    try:
        return _open_named(prefix, name, spec, split, root, download)
    except BaseException:
        for folder in created:  # ours alone: it did not exist before this call
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _open_named(prefix: str, name: str, spec: str, split: str, root: Optional[str], download: bool) -> Dataset:
    import timm.data

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
    except URLError as e:  # torchvision's download: one line in our words, not "<urlopen error [Errno -2] ...>"
        why = first_line(e.reason) if isinstance(e.reason, BaseException) else e.reason
        raise VitconvertError(f"cannot download {spec} into {root}: the network does not answer ({why})") from None
    except (RuntimeError, OSError, FileNotFoundError, ValueError, AssertionError) as e:
        reason = first_line(e)
        hint = "" if download else f"; pass {param('download', True)} to fetch it (needs a network)"
        raise VitconvertError(f"cannot open {spec} ({split}) under {root or 'the Hugging Face cache'}: "
                              f"{reason}{hint}") from None


def open_folder(root: Path, split: str, classes: Optional[Sequence[str]] = None, whose: str = "",
                strict: bool = True) -> Dataset:
    """An image folder root with ``train/`` and ``val/`` (class subfolders inside), read as timm's ImageDataset;
    labelled by ``classes`` when given (``align_classes``)."""
    folder = split_folder(root, split)
    reader = ClassFolderReader(folder)
    check_images(folder, reader)
    if classes:
        align_classes(reader, folder, list(classes), whose, strict)
    return as_dataset(reader, split)


def split_folder(root: Path, split: str) -> Path:
    """The folder of ``split`` under an image folder root. An evaluation split's synonyms (val/, valid/, ...)
    stand in for one another; any other name (test, a typo) means exactly that folder, never a silent val/."""
    if not root.is_dir():
        raise VitconvertError(f"data folder not found: {root} (expected a folder with train/ and val/, a timm "
                              "dataset name like torch/cifar100, or digits)")
    names = TRAIN_SPLITS if is_train_split(split) else (split, *EVAL_FOLDERS) if split in EVAL_FOLDERS[:5] else (
        split,)
    names = tuple(dict.fromkeys(names))  # once each: val, valid, validation (not val/val/valid)
    folder = next((root / n for n in names if (root / n).is_dir()), None)
    if folder is None:
        have = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise VitconvertError(f"{root} has no {'/'.join(names[:3])}/ folder for the {split} split (it has: "
                              f"{', '.join(have) or 'no folders'})")
    return folder


def check_images(folder: Path, reader: ClassFolderReader) -> None:
    """A split folder with images, and every class folder with some: an empty class would shift the labels of
    every class after it."""
    if not reader.samples:
        raise VitconvertError(f"{folder} holds no images (class subfolders of {', '.join(IMAGE_EXTENSIONS[:3])}...)")
    empty = [name for name in reader.folders if name not in reader.class_to_idx]
    if empty:
        raise VitconvertError(f"{folder} has class folders without images ({', '.join(empty[:5])}): an empty class "
                              "is no class at all, and every class after it would take its label; add its images "
                              "or remove the folder")


def class_names(ds: Dataset) -> Optional[list[str]]:
    """An image folder's class names in label order (None for datasets that do not name their classes)."""
    mapping = getattr(getattr(ds, "reader", None), "class_to_idx", None) or getattr(ds, "class_to_idx", None)
    if not isinstance(mapping, dict) or not mapping:
        return None
    return [str(name) for name, _ in sorted(mapping.items(), key=lambda kv: kv[1])]


def align_classes(reader: ClassFolderReader, folder: Path, classes: list[str], whose: str,
                  strict: bool = True) -> None:
    """Label ``folder``'s images by ``classes`` (names, in label order) instead of by their sorted position, so a
    split missing a class, or a model's own label names, keep every label right. Names compare as Unicode NFC.
    A class folder ``classes`` lacks is refused; with ``strict=False`` a folder sharing no name with
    ``classes`` keeps its own order (a model's label names may be words where the user's folders are their own
    names), and says so: that order is then the only link between folders and labels."""
    found = list(reader.class_to_idx)
    wanted = [same_name(c) for c in classes]
    if [same_name(n) for n in found] == wanted:
        return
    unknown = [name for name in found if same_name(name) not in wanted]
    shown = ", ".join(classes[:12]) + (", ..." if len(classes) > 12 else "")
    if len(unknown) == len(found) and not strict:
        pairs = ", ".join(f"{name} -> {classes[i]}" for i, name in enumerate(found[:4]) if i < len(classes))
        warnings.warn(f"{folder}'s class folders share no name with {whose}, so they are labelled by sorted order "
                      f"({pairs}{', ...' if len(found) > 4 else ''}); rename them to {whose} if that is not "
                      "their order", ClassOrderWarning, stacklevel=3)
        return
    if unknown:
        raise VitconvertError(f"{folder} has class folders not among {whose} ({', '.join(unknown[:5])}): their "
                              f"labels would be wrong; {whose}: {shown}")
    reader.relabel({name: i for i, name in enumerate(classes)})


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


def check_classes(ds: Dataset, head: int, what: str = "student", fix: Optional[str] = None) -> None:
    """Refuse data whose class count is not the head's: labels past the head would index out of range, fewer would
    train a head with dead classes. ``fix`` says what to do instead of training a new head (eval's case)."""
    found = dataset_classes(ds)
    if found is not None and found != head:
        fix = fix or f"convert the source model with {param('num_classes', found)} (a new, random head)"
        raise VitconvertError(f"the data has {plural(found, 'class', 'classes')} but the {what}'s head has {head}: "
                              f"{fix}")
