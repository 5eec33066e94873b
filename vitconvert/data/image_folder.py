"""An image folder split (``val/<class>/...``) read as timm's ImageDataset does, labelled by the class folder.

Why not timm's own folder reader: it labels an image by the folder it sits in (``train/cat/sub/x.png`` becomes
class ``sub``), follows a symlink loop until the OS stops it (counting the same images ~40 times), gives a loose
image in ``val/`` a class named ``""`` and knows only .png/.jpg/.jpeg. Here every image under
``<class>/``, however deep, is that class; a folder reached twice, a loose image and an unknown layout are refused
in one line; and any format Pillow reads by default counts. Class and image order are timm's (natural sort),
so a flat folder labels exactly as before.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import IO, Any

from ..errors import VitconvertError

# What Pillow opens out of the box (RGB, grey, palette, 16-bit): the photo and scan formats people keep.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")


def same_name(name: str) -> str:
    """A class name as compared: Unicode NFC, since macOS and some archives store file names decomposed (NFD), so
    ``é`` in a folder name and in a model's label names may be different code points for the same text."""
    return unicodedata.normalize("NFC", name)


def is_image(name: str) -> bool:
    """Whether a file name is an image the reader opens (hidden files, such as macOS's ._ files, are not)."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def upright(image: Any) -> Any:
    """A PIL image turned as its EXIF orientation says: a phone photo held sideways stores the sensor's pixels
    and the turn in a tag, which every viewer (and transformers' ``load_image``) applies; read as stored it is
    a different picture."""
    read_exif = getattr(image, "getexif", None)
    if read_exif is None or read_exif().get(0x0112, 1) in (None, 1):  # 0x0112: Orientation; 1 = as stored
        return image
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)


def class_folders(folder: Path) -> list[str]:
    """The split's class folders in timm's order (natural sort), refusing images that sit in no class."""
    from timm.utils.misc import natural_key

    loose = sorted(p.name for p in folder.iterdir() if p.is_file() and is_image(p.name))
    if loose:
        raise VitconvertError(f"{folder} holds images outside any class folder ({', '.join(loose[:3])}): their class "
                              f"is unknown; move them into {folder}/<class>/")
    return sorted((p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=natural_key)


def images_under(class_dir: Path, seen: dict[tuple[int, int], str]) -> list[str]:
    """Every image file under ``class_dir``, following links to folders (a linked data set is common) but never
    into a folder already read: a link back up the tree would otherwise count the same images again and again."""
    found: list[str] = []
    for root, dirs, files in os.walk(class_dir, followlinks=True):
        info = os.stat(root)
        key = (info.st_dev, info.st_ino)
        if key in seen:
            raise VitconvertError(f"{root} is {seen[key]} again (a link back into the data): its images would be "
                                  "counted more than once; remove the link")
        seen[key] = root
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.join(root, f) for f in files if is_image(f)]
    return found


def scan(folder: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The class folders in timm's order and the images of each."""
    classes = class_folders(folder)
    seen: dict[tuple[int, int], str] = {}
    return classes, {name: images_under(folder / name, seen) for name in classes}


def as_dataset(reader: ClassFolderReader, split: str) -> Any:
    """timm's ImageDataset over ``reader``; images as stored (``input_img_mode=None``: TransformedDataset makes
    them RGB, scaling 16-bit grey rather than clipping it)."""
    import timm.data

    return timm.data.ImageDataset(reader.root, reader=reader, split=split, input_img_mode=None)


class ClassFolderReader:
    """timm's Reader interface (items, ``samples``, ``class_to_idx``, filenames) over :func:`scan`; duck-typed,
    so that importing this module does not import timm."""

    def __init__(self, root: Path):
        self.root = str(root)
        self.folders, self._images = scan(Path(root))
        self.relabel({name: i for i, name in enumerate(n for n in self.folders if self._images[n])})

    def relabel(self, class_to_idx: dict[str, int]) -> None:
        """Label each class folder by ``class_to_idx`` (names compared as NFC); folders it lacks are left out."""
        from timm.utils.misc import natural_key

        by_name = {same_name(name): label for name, label in class_to_idx.items()}
        samples = [(path, by_name[same_name(name)]) for name in self.folders if same_name(name) in by_name
                   for path in self._images[name]]
        self.samples = sorted(samples, key=lambda s: natural_key(s[0]))
        self.class_to_idx = dict(class_to_idx)  # every class of the map, also those this split lacks

    def __getitem__(self, index: int) -> tuple[IO[bytes], int]:
        path, target = self.samples[index]
        return open(path, "rb"), target  # noqa: SIM115 (PIL reads it lazily, as timm's reader hands it over)

    def __len__(self) -> int:
        return len(self.samples)

    def filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        """Sample ``index``'s path, in the forms timm's readers offer."""
        name = self.samples[index][0]
        if basename:
            return os.path.basename(name)
        return name if absolute else os.path.relpath(name, self.root)

    def filenames(self, basename: bool = False, absolute: bool = False) -> list[str]:
        """Every sample's path, in the forms timm's readers offer."""
        return [self.filename(i, basename, absolute) for i in range(len(self))]
