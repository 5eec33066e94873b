"""Where a student stands against its teacher: per-layer attention and block gaps, then logit agreement.

The distillation loss is one number summed over layers; a user deciding whether to train longer, or which
layers to look at, needs it per layer. Both models see the same images (each normalised its own way), the
attention outputs come from the same hooks distillation uses (``capture.py``), each on the model's own
hidden states, so a gap early in the network shows up again, amplified, in the blocks after it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset

from .attention import LinearAttention
from .capture import DistillStudent, TeacherTap, attention_pairs
from .data import (
    InputConfig,
    TransformedDataset,
    accepts_size,
    eval_transform,
    input_config,
    make_loader,
    model_input_size,
    open_dataset,
    size_text,
    teacher_normalizer,
)
from .errors import BadValue, VitconvertError, param, plural
from .loading import load_student, load_teacher, model_threads, teacher_spec
from .surgery import attention_modules, find_softmax_attention
from .writer import PNG_METADATA, atomic_file


@dataclass
class LayerGap:
    """One layer's distance between student and teacher, averaged over every token of every image."""

    layer: int
    attn_mse: float
    attn_cos: float
    block_cos: float
    attention: str = "linear"  # the student's attention there: its variant, or "softmax" where a hybrid kept it


@dataclass
class CompareReport:
    """The comparison; ``to_dict()`` is plain JSON (the CLI's --json, the run folder, the model card)."""

    layers: list[LayerGap]
    top1_agreement: Optional[float]  # None when the heads differ (a re-headed student)
    logit_kl: Optional[float]  # KL(teacher || student) of the class distributions, mean over images
    images: int

    def to_dict(self) -> dict[str, Any]:
        """The report as ``compare --json`` prints it and compare.json stores it."""
        return {"layers": [asdict(gap) for gap in self.layers], "top1_agreement": self.top1_agreement,
                "logit_kl": self.logit_kl, "images": self.images}


class BlockOutputs:
    """Forward hooks keeping each block's output (``capture.py`` hooks attention modules only)."""

    def __init__(self, blocks: list[nn.Module]):
        self.outputs: list[torch.Tensor] = []
        self.handles = [b.register_forward_hook(self._hook) for b in blocks]

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.outputs.append(output[0] if isinstance(output, (tuple, list)) else output)

    def take(self) -> list[torch.Tensor]:
        """The outputs captured since the last call, handed over and forgotten so memory stays flat."""
        outputs, self.outputs = self.outputs, []
        return outputs

    def close(self) -> None:
        """Remove the hooks, so the model runs without them after the comparison."""
        for handle in self.handles:
            handle.remove()


def paired_attention(teacher: nn.Module, student: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(teacher, student) attention modules layer by layer; a softmax student (a sanity check) pairs too."""
    if any(isinstance(m, LinearAttention) for m in student.modules()):
        attention_pairs(student, teacher)  # the same checks as distill's: depth and width
        return [m for _, m in find_softmax_attention(teacher)], [m for _, m in attention_modules(student)]
    theirs = [m for _, m in find_softmax_attention(teacher)]
    mine = [m for _, m in find_softmax_attention(student)]
    if not theirs:
        raise VitconvertError(f"the teacher has no softmax attention: give a softmax ViT as {param('teacher')}")
    if len(mine) != len(theirs):
        raise VitconvertError(f"teacher and student differ in depth: {len(theirs)} vs {len(mine)} attention "
                              f"layers; use the student's softmax source as {param('teacher')}")
    return theirs, mine


def parent_blocks(model: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    """The block holding each attention module (``blocks.3`` for ``blocks.3.attn``)."""
    names = {id(m): n for n, m in model.named_modules()}
    parents = [names[id(m)].rpartition(".")[0] for m in modules]
    if any(not p for p in parents):
        raise VitconvertError(f"{type(model).__name__} has attention outside any block; cannot compare blocks")
    return [model.get_submodule(p) for p in parents]


class _Sums:
    """Running sums of one layer's distances (exact means over any number of batches)."""

    def __init__(self) -> None:
        self.sq_err = self.elements = self.attn_cos = self.block_cos = self.tokens = 0.0

    def add(self, attn_s: torch.Tensor, attn_t: torch.Tensor, block_s: torch.Tensor, block_t: torch.Tensor) -> None:
        attn_s, attn_t = attn_s.float(), attn_t.float().to(attn_s.device)
        self.sq_err += (attn_s - attn_t).pow(2).sum().item()
        self.elements += attn_s.numel()
        cos = F.cosine_similarity(attn_s, attn_t, dim=-1)
        self.attn_cos += cos.sum().item()
        self.tokens += cos.numel()
        self.block_cos += F.cosine_similarity(block_s.float(), block_t.float().to(block_s.device), dim=-1).sum().item()

    def gap(self, layer: int) -> LayerGap:
        return LayerGap(layer, self.sq_err / self.elements, self.attn_cos / self.tokens, self.block_cos / self.tokens)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def compare_models(teacher: nn.Module, student: nn.Module, batches: Iterable[Any],
                   inp: Optional[InputConfig] = None) -> CompareReport:
    """Per-layer attention/block gaps and logit agreement of ``student`` against ``teacher``.

    ``batches`` yields images (or (images, labels)) normalised as ``inp`` says (default: the student's
    pretrained_cfg, as :func:`image_batches` gives them; distill passes its own). The teacher gets them
    re-normalised to its own mean/std. The teacher is frozen (as in distillation); the student runs in
    eval mode and gets its mode back.
    """
    attn_t, attn_s = paired_attention(teacher, student)
    to_teacher = teacher_normalizer(inp or input_config(student), teacher, _device(teacher))
    tap, wrapped = TeacherTap(teacher, attn_t, keep_inputs=False), DistillStudent(student, attn_s)
    blocks_t, blocks_s = BlockOutputs(parent_blocks(teacher, attn_t)), BlockOutputs(parent_blocks(student, attn_s))
    sums = [_Sums() for _ in attn_t]
    agree = kl = 0.0
    images_seen, heads_match = 0, True
    was_training = student.training
    student.eval()
    try:
        for batch in batches:
            images = batch[0] if isinstance(batch, (tuple, list)) else batch
            if not images_seen and not accepts_size(teacher, tuple(images.shape[-2:])):
                raise VitconvertError(f"the teacher takes {size_text(model_input_size(teacher))} images, the data "
                                      f"is {size_text(tuple(images.shape[-2:]))} (the student's size); give a "
                                      "teacher built at it")
            images_t = images.to(_device(teacher))
            logits_t, outs_t, _ = tap(to_teacher(images_t) if to_teacher else images_t)
            logits_s, outs_s = wrapped(images.to(_device(student)))
            for layer, row in enumerate(zip(outs_s, outs_t, blocks_s.take(), blocks_t.take(), strict=True)):
                sums[layer].add(*row)
            heads_match = heads_match and logits_t.shape == logits_s.shape
            if heads_match:
                logits_t = logits_t.float().to(logits_s.device)
                log_t, log_s = F.log_softmax(logits_t, -1), F.log_softmax(logits_s.float(), -1)
                agree += (logits_t.argmax(-1) == logits_s.argmax(-1)).sum().item()
                kl += F.kl_div(log_s, log_t, log_target=True, reduction="sum").item()
            images_seen += images.shape[0]
    finally:
        for hooks in (tap, wrapped, blocks_t, blocks_s):
            hooks.close()
        student.train(was_training)
    if not images_seen:
        raise VitconvertError("no images to compare on (the data is empty)")
    kl_mean = max(kl / images_seen, 0.0)  # float rounding can dip an exact zero just below it
    kinds = [getattr(m, "variant", "softmax") for m in attn_s]
    gaps = [replace(s.gap(i), attention=kinds[i]) for i, s in enumerate(sums)]
    return CompareReport(gaps, agree / images_seen if heads_match else None,
                         kl_mean if heads_match else None, images_seen)


def image_batches(data: str, model: nn.Module, split: str = "val", batches: int = 10, batch_size: int = 32,
                  seed: int = 0, workers: int = 0, data_dir: Optional[str] = None,
                  download: bool = False) -> DataLoader:
    """A fixed random sample of ``batches × batch_size`` images of ``data`` through ``model``'s eval transform.

    Random rather than the first images, because folders list their classes in order. Errors (a missing
    folder, an unknown dataset) surface here, before any model runs.
    """

    for name, value in (("batches", batches), ("batch_size", batch_size)):
        if value < 1:
            raise BadValue(name, f"must be at least 1 (got {value})")
    base = open_dataset(data, split, data_dir, download)
    chosen = torch.randperm(len(base), generator=torch.Generator().manual_seed(seed))[:batches * batch_size]
    sample = TransformedDataset(Subset(base, chosen.tolist()), eval_transform(input_config(model)))
    return make_loader(sample, batch_size, seed, train=False, workers=workers)


@dataclass
class StudentComparison:
    """What ``vitconvert compare`` reports: the comparison, and the teacher it was made against."""

    report: CompareReport
    teacher: str  # the teacher's SOURCE: as named, or the one the student records


def compare_student(student: str, data: str, teacher: Optional[str] = None, *, split: str = "val",
                    batches: int = 10, batch_size: int = 32, workers: int = 0, data_dir: Optional[str] = None,
                    download: bool = False, pretrained: Optional[bool] = None,
                    threads: Optional[int] = None) -> StudentComparison:
    """A vitconvert folder (or run folder, or Hub id) against its softmax teacher — ``teacher``, else the source
    it was converted from, rebuilt as convert built it — on a fixed sample of ``data``. ``pretrained`` chooses a
    named teacher's weights (default: as the student's source was built); ``threads``: torch's CPU threads
    meanwhile (``loading.model_threads``, as ``vitconvert compare --threads``)."""
    with model_threads(threads, student):
        model = load_student(student)
        spec = teacher_spec(model, teacher)
        softmax = load_teacher(spec, model, seed=0, recorded=teacher is None, pretrained=pretrained)
        loader = image_batches(data, model, split, batches, batch_size, workers=workers, data_dir=data_dir,
                               download=download)
        return StudentComparison(compare_models(softmax, model, loader), spec)


def has_matplotlib() -> bool:
    """Whether plots can be drawn: matplotlib is optional (``pip install 'vitconvert[plot]'``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    """Stop with one clear error when plotting is asked for and matplotlib is missing (compare's and bench's)."""
    if not has_matplotlib():
        raise VitconvertError("plotting needs matplotlib: pip install 'vitconvert[plot]'")


def plot_compare(report: CompareReport, path: Union[str, Path], title: str = "student vs teacher",
                 force: bool = False, inputs: Iterable[Union[str, Path]] = ()) -> Path:
    """A PNG of the per-layer curves at ``path`` (writer.atomic_file's rules: a new .png, or one vitconvert
    wrote with ``force``; never an input)."""
    figure = compare_figure(report, title)
    with atomic_file(path, force=force, inputs=inputs, name="plot", suffix=".png") as tmp:
        figure.savefig(tmp, format="png", dpi=120, metadata=PNG_METADATA)
    return Path(path).expanduser()


def compare_figure(report: CompareReport, title: str = "student vs teacher") -> Any:
    """The per-layer curves as a matplotlib Figure: cosines above (1 is a perfect match), attention MSE below."""
    require_matplotlib()
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, safe in servers and threads
    from matplotlib.ticker import MaxNLocator

    layers = [g.layer for g in report.layers]
    fig = Figure(figsize=(7, 5.5), constrained_layout=True)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(layers, [g.attn_cos for g in report.layers], marker="o", label="attention-output cosine")
    top.plot(layers, [g.block_cos for g in report.layers], marker="s", label="block-output cosine")
    top.set_ylabel("cosine similarity")
    top.legend(loc="best")
    bottom.plot(layers, [g.attn_mse for g in report.layers], marker="o", color="tab:red", label="attention-output MSE")
    if all(g.attn_mse > 0 for g in report.layers):
        bottom.set_yscale("log")
    bottom.set_ylabel("MSE")
    bottom.set_xlabel("layer")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend(loc="best")
    summary = plural(report.images, "image")
    if report.top1_agreement is not None:
        summary += f", top-1 agreement {report.top1_agreement:.1%}, logit KL {report.logit_kl:.4g}"
    fig.suptitle(f"{title} ({summary})", fontsize=10)
    return fig
