"""Any model by the name a user gives: a vitconvert folder (linear) or a softmax source, and a distill run's pair.

The one place that decides between ``folder`` (our format) and ``sources`` (softmax models through timm), so
neither has to know the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .errors import VitconvertError
from .folder import folder_block, load_folder_model, read_config
from .hub_io import hub_snapshot
from .sources import LinearSourceError, load_source


def load(spec: Union[str, Path]) -> nn.Module:
    """A model from a vitconvert folder, a run folder or ``hf-hub:org/name[@rev]`` (or any timm source)."""
    spec = str(spec)
    if spec.startswith("hf-hub:"):
        folder = hub_snapshot(spec)
    else:
        folder = Path(spec.removeprefix("local-dir:")).expanduser()
        if not folder.exists():  # a timm name or the bundled digits (load_source says "path not found" for paths)
            return load_source(spec).model
    if folder.is_dir() and folder_block(read_config(folder)) is not None:  # also one timm's save_for_hf wrote
        return load_folder_model(folder, read_config(folder))
    return load_source(spec).model


def load_student(spec: str) -> nn.Module:
    """A vitconvert model folder or run folder (linear attention, loaded strictly)."""
    path = Path(spec).expanduser()
    if not spec.startswith("hf-hub:"):
        if path.is_file():
            raise VitconvertError(f"{spec} is a file, not a model folder: give the folder `vitconvert convert` "
                                  "wrote")
        if not path.is_dir():
            raise VitconvertError(f"student folder not found: {spec}")
        if folder_block(read_config(path)) is None:
            raise VitconvertError(f"{spec} is not a vitconvert model folder: convert it first "
                                  f"(`vitconvert convert {spec} --to VARIANT`)")
    return load(spec)


def teacher_spec(student: nn.Module, override: Optional[str]) -> str:
    """--teacher, else the source the student records."""
    if override:
        return override
    source = getattr(student, "vitconvert_report", {}).get("source")
    if not source:
        raise VitconvertError("the student records no source model: name the softmax teacher with --teacher")
    return str(source)


def load_teacher(spec: str, student: nn.Module, seed: int, recorded: bool) -> nn.Module:
    """The softmax teacher, at the student's image size.

    The student's own source (``spec`` is the recorded one) is rebuilt as convert built it: at the recorded
    ``--img-size`` and, for a random-init source (--no-pretrained), from the recorded seed, so the teacher *is*
    the model the student was converted from (its kept softmax layers match the teacher's exactly). Another
    teacher is built under ``seed`` and its position embeddings resampled to the student's size."""
    report = getattr(student, "vitconvert_report", {})
    pretrained = bool(report.get("pretrained", True))
    own = spec == str(report.get("source"))
    kwargs = {"img_size": report["source_img_size"]} if own and report.get("source_img_size") else {}
    if own and not pretrained:
        if "source_seed" not in report:
            raise VitconvertError(f"the student was converted from a randomly initialised {spec} (no pretrained "
                                  "weights) by an older vitconvert that did not record its seed: that teacher "
                                  "cannot be rebuilt; convert it again, or name a softmax teacher with --teacher")
        seed = int(report["source_seed"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            source = load_source(spec, pretrained=pretrained, **kwargs)
        except LinearSourceError:
            raise VitconvertError(f"the teacher {spec} is a linear-attention vitconvert model; give a softmax "
                                  "ViT") from None
        except VitconvertError as e:
            if not recorded:
                raise
            raise VitconvertError(f"cannot load the teacher {spec!r} (the student's recorded source): {e}; "
                                  "name it with --teacher") from None
    teacher = source.model.eval()
    size = input_size(student)
    if size is not None and input_size(teacher) not in (None, size) and hasattr(teacher, "set_input_size"):
        teacher.set_input_size(img_size=size)  # the student's size: timm resamples the position embeddings
    return teacher


def input_size(model: nn.Module) -> Optional[int]:
    """The square image size a fixed-size ViT is built for (None for any-size models such as NaFlexViT)."""
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        return None
    return int(size[-1] if isinstance(size, (tuple, list)) else size)
