"""Top-1/top-5 accuracy, loss and throughput of any model (linear or softmax) on a dataset split.

The same loop validates every epoch of a distill run (its sums are then added across processes), so
``vitconvert eval RUN`` and the run's own validation report the same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from .data import TransformedDataset, check_classes, eval_transform, input_config, make_loader, open_dataset
from .distributed import pick_device
from .errors import BadValue, VitconvertError, param
from .loading import load, model_threads
from .top_k import top_k_score


def autocast_for(device: torch.device, enabled: bool = True, dtype: str = "bfloat16") -> AbstractContextManager:
    """bf16 (or fp16) autocast on CUDA; CPU runs stay float32, the reference numbers."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=getattr(torch, dtype))
    return nullcontext()


@torch.no_grad()
def eval_sums(forward: Callable[[torch.Tensor], torch.Tensor], loader: DataLoader, device: torch.device,
              amp: bool = True, channels_last: bool = False, amp_dtype: str = "bfloat16") -> torch.Tensor:
    """[loss sum, top-1 hits, top-5 hits, images, seconds]; targets < 0 (padding for equal shares) are skipped.

    ``amp_dtype`` is the training run's: a float16 run is on a GPU without bf16, where bf16 autocast raises."""
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    start = time.perf_counter()
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast_for(device, amp, amp_dtype):
            logits = forward(images)
        logits = logits.float()
        keep = targets >= 0
        logits, targets = logits[keep], targets[keep]
        if targets.numel() == 0:
            continue
        if int(targets.max()) >= logits.shape[-1]:
            raise VitconvertError(f"the data has labels up to {int(targets.max())} but the model has "
                                  f"{logits.shape[-1]} classes")
        top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
        hits = top == targets[:, None]
        sums[0] += F.cross_entropy(logits, targets, reduction="sum").double()
        sums[1] += hits[:, :1].any(-1).sum()
        sums[2] += hits.any(-1).sum()
        sums[3] += targets.numel()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sums[4] = time.perf_counter() - start
    return sums


def metrics_from_sums(sums: torch.Tensor, classes: int) -> dict[str, Any]:
    """top1, top5 (None for ``classes`` ≤ 5: :mod:`.top_k`), loss and images/s from the summed counts, and the
    classes; refused when there is nothing to measure."""
    loss, top1, top5, n, seconds = sums.tolist()
    if n == 0:
        raise VitconvertError("the evaluation split holds no images")
    if not math.isfinite(loss):  # NaN logits rank arbitrarily: a top-1 from them would be a number about nothing
        raise VitconvertError("the model's outputs are NaN or infinite: no accuracy can be measured (its weights "
                              "or attention options are broken; `vitconvert info` shows them)")
    return {"top1": top1 / n, "top5": top_k_score(top5, n, classes), "loss": loss / n, "n": int(n),
            "img_s": n / seconds if seconds > 0 else float("inf"), "classes": classes}


def evaluate(model: Union[str, Path, nn.Module], data: str, split: str = "val", batch_size: int = 64,
             device: Optional[str] = None, data_dir: Optional[str] = None, download: bool = False,
             workers: Optional[int] = 0, amp: bool = True, pretrained: bool = True,
             threads: Optional[int] = None) -> dict[str, Any]:
    """{"top1", "top5" (fractions; top5 None for 5 classes or fewer), "loss", "n", "img_s", "classes"} of
    ``model`` on ``data``'s ``split``: a model, or any SOURCE ``vitconvert.load`` takes (``pretrained=False``: a
    timm name's random init). ``threads``: torch's CPU threads meanwhile (``loading.model_threads``, as
    ``vitconvert eval --threads``)."""

    if batch_size < 1:
        raise BadValue("batch_size", f"must be at least 1 (got {batch_size})")
    if workers is not None and workers < 0:
        raise BadValue("workers", f"must not be negative (got {workers}; 0 loads in this process)")
    with model_threads(threads, model):
        return _evaluate(model, data, split, batch_size, device, data_dir, download, workers, amp, pretrained)


def _evaluate(model: Union[str, Path, nn.Module], data: str, split: str, batch_size: int, device: Optional[str],
              data_dir: Optional[str], download: bool, workers: Optional[int], amp: bool,
              pretrained: bool) -> dict[str, Any]:
    net = model if isinstance(model, nn.Module) else load(model, pretrained=pretrained)
    dev = pick_device(device, 0)
    classes = getattr(net, "num_classes", None)
    if not classes:
        raise VitconvertError("the model has no classification head (num_classes 0): it outputs features, not "
                              f"class scores, so there is no accuracy to measure; convert it with "
                              f"{param('num_classes', 'N')} and distill it, or evaluate a model with a head")
    names = label_names(net)
    base = open_dataset(data, split, data_dir, download, classes=names, whose="the model's label names", strict=False)
    check_classes(base, classes, what="model", fix=data_to_give(names, classes))
    ds = TransformedDataset(base, eval_transform(input_config(net)))
    loader = make_loader(ds, batch_size, 0, train=False, workers=workers, pin_memory=dev.type == "cuda")
    net = net.eval().to(dev)
    return metrics_from_sums(eval_sums(net, loader, dev, amp=amp), classes)


def data_to_give(names: Optional[list[str]], head: int) -> str:
    """What eval's data should be when its classes are not the head's (a new head, distill's fix, measures nothing)."""
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return f"give data of its classes: class folders named by its label names ({shown}) may be any subset of them"
    return f"give data of the {head} classes it was trained on, one class folder each, in its label order"


def label_names(model: nn.Module) -> Optional[list[str]]:
    """The class names the model carries (timm's pretrained_cfg label_names), when there is one per output."""
    names = getattr(model, "pretrained_cfg", {}).get("label_names")
    if isinstance(names, (list, tuple)) and len(names) == getattr(model, "num_classes", None):
        return [str(n) for n in names]
    return None
