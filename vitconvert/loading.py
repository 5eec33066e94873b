"""Any model by the name a user gives: a vitconvert folder (linear) or a softmax source, and a distill run's pair.

The one place that decides between ``folder`` (our format) and ``sources`` (softmax models through timm), so
neither has to know the other; both start from ``sources.resolve``, the one reading of a SOURCE string.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .errors import VitconvertError, param
from .folder import load_folder_model, read_config
from .hub_io import cached_weights
from .provenance import report_of
from .public_names import shown_as_local
from .sources import (
    SOFTMAX_FORMS,
    WEIGHT_SUFFIXES,
    LinearSourceError,
    Resolved,
    SourceNotFound,
    config_beside,
    load_source,
    resolve,
)
from .threads import torch_threads

SMALL_MODEL_BYTES = 40 * 2**20  # ~10M float32 parameters: more threads than one only add waiting
LINEAR_FORMS = "a vitconvert model or run folder: a path, local-dir:PATH or hf-hub:org/name[@revision]"
ANY_FORMS = ("a vitconvert model or run folder, hf-hub:org/name[@revision], a timm name or alias, digits, or a timm "
             "model folder (PATH or local-dir:PATH)")


def load(spec: Union[str, Path, Resolved], pretrained: bool = True) -> nn.Module:
    """Any model a SOURCE names: a vitconvert model or run folder (a path, ``local-dir:``, ``hf-hub:org/name[@rev]``)
    or a softmax source (a timm name or alias, ``digits``, a timm folder); ``pretrained=False``: a timm name's
    random init. A bare weights file needs its architecture: ``sources.load_source(path, arch=...)`` reads it."""
    resolved = spec if isinstance(spec, Resolved) else resolve(spec)
    if resolved.linear:
        assert resolved.path is not None
        return load_folder_model(resolved.path, read_config(resolved.path))
    if resolved.kind == "file":
        refuse_file(resolved, ANY_FORMS)
    return load_source(resolved, pretrained=pretrained).model


def refuse_file(resolved: Resolved, forms: str) -> None:
    """One line for a file where a model is wanted (a bare weights file has no architecture to build it with)."""
    assert resolved.path is not None
    if resolved.path.suffix in WEIGHT_SUFFIXES:
        raise VitconvertError(f"{resolved.path.name} is a bare weights file with no architecture: give the model "
                              f"folder it belongs to (convert also reads it with its timm architecture)")
    raise VitconvertError(f"{resolved.path.name} is a file, not a model: give {forms}")


def linear_folder(spec: str, role: str = "model") -> Path:
    """The vitconvert folder ``spec`` names (a model or run folder, local or a Hub snapshot), or one line saying
    what it names instead; ``role`` names it in that line ("student")."""
    try:
        resolved = resolve(spec)
    except SourceNotFound:
        raise VitconvertError(f"{role} folder not found: {spec} (give {LINEAR_FORMS})") from None
    if resolved.kind == "file":
        raise VitconvertError(f"{spec} is a file, not a model folder (give {LINEAR_FORMS})")
    if not resolved.linear:
        what = "a timm model name" if resolved.kind == "timm" else "a softmax model"
        raise VitconvertError(f"{spec} is not a vitconvert model folder ({what}): convert it first")
    assert resolved.path is not None
    return resolved.path


def load_student(spec: str) -> nn.Module:
    """A vitconvert model folder or run folder (linear attention, loaded strictly)."""
    folder = linear_folder(spec, "student")
    return load_folder_model(folder, read_config(folder))


def teacher_spec(student: nn.Module, override: Optional[str]) -> str:
    """``override`` (the teacher the user named), else the source the student records."""
    if override:
        return override
    source = report_of(student).get("source")
    if not source:
        raise VitconvertError(f"the student records no source model: name the softmax teacher with "
                              f"{param('teacher')}")
    return str(source)


def refuse_a_source_named_only(spec: str, own: bool) -> None:
    """A pushed copy records a local source by its name only (``src (local)``, :mod:`.public_names`): it was a
    folder on the machine that converted it, so the teacher must be named."""
    if own and shown_as_local(spec):
        raise VitconvertError(f"the student's source, {spec}, was a local folder or file where it was converted (a "
                              f"Hub copy names it only): name its softmax teacher with {param('teacher')}")


def load_teacher(spec: str, student: nn.Module, seed: int, recorded: bool,
                 pretrained: Optional[bool] = None) -> nn.Module:
    """The softmax teacher, at the student's image size.

    The student's own source (``spec`` is the recorded one) is rebuilt as convert built it: at the recorded
    image size and, for a random-init source (``pretrained=False``), from the recorded seed, so the teacher *is*
    the model the student was converted from (its kept softmax layers match the teacher's exactly). Another
    teacher is built under ``seed`` and its position embeddings resampled to the student's size; ``pretrained``
    chooses its weights (default: as the student's source was built), so a named teacher can be a random one
    on a machine without its weights."""
    report = report_of(student)
    own = spec == str(report.get("source"))
    refuse_a_source_named_only(spec, own)
    recorded_pretrained = bool(report.get("pretrained", True))
    pretrained = recorded_pretrained if own or pretrained is None else pretrained
    kwargs = {"img_size": report["source_img_size"]} if own and report.get("source_img_size") else {}
    if own and not pretrained:
        if "source_seed" not in report:
            raise VitconvertError(f"the student was converted from a randomly initialised {spec} (no pretrained "
                                  "weights) by an older vitconvert that did not record its seed: that teacher "
                                  "cannot be rebuilt; convert it again, or name a softmax teacher with "
                                  f"{param('teacher')}")
        seed = int(report["source_seed"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            resolved = resolve(spec)
            arch = report.get("source_arch") if own and resolved.kind == "file" else None  # convert's --arch
            if resolved.kind == "file" and arch is None and not config_beside(resolved.path, spec):
                refuse_file(resolved, SOFTMAX_FORMS)  # no architecture: neither --arch nor a config.json beside it
            source = load_source(resolved, pretrained=pretrained, arch=arch, **kwargs)
        except LinearSourceError:
            raise VitconvertError(f"the teacher {spec} is a linear-attention vitconvert model; give a softmax "
                                  "ViT") from None
        except VitconvertError as e:
            if not recorded:
                raise
            raise VitconvertError(f"cannot load the teacher {spec!r} (the student's recorded source): {e}; "
                                  f"name it with {param('teacher')}") from None
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


def job_threads(threads: Optional[int], spec: Any) -> Optional[int]:
    """``threads``, else 1 when ``spec`` is or names a small model (a model in hand, a local folder or file, the
    bundled digits, or an hf-hub: repo already in the Hub cache) and the user set no OMP_NUM_THREADS, else None
    (torch's default). On a small model torch's one thread per core only synchronise: on a busy 2-core machine a
    20 s walk-through took 355 s with two."""
    if threads is not None or os.environ.get("OMP_NUM_THREADS") or spec is None:
        return threads
    if isinstance(spec, nn.Module):
        return 1 if sum(p.numel() * p.element_size() for p in spec.parameters()) < SMALL_MODEL_BYTES else None
    try:
        if str(spec).startswith("hf-hub:"):  # counted in the cache: a Hub model is not fetched just for this
            files = cached_weights(str(spec))
        else:
            path = resolve(spec).path
            files = [] if path is None else [path] if path.is_file() else list(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
    except (VitconvertError, OSError, ValueError):  # the job's own loading says what is wrong with it
        return None
    return 1 if files and size < SMALL_MODEL_BYTES else None


def model_threads(threads: Optional[int], spec: Any) -> AbstractContextManager[None]:
    """Around a job on the model ``spec`` names: torch's CPU threads as :func:`job_threads` counts them, the
    caller's count back after. The library's jobs and the commands both run under it, so a Python caller gets what
    the command line gets."""
    return torch_threads(job_threads(threads, spec))
