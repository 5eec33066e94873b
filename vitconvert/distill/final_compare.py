"""The end of a run: where the final student stands against its teacher, layer by layer.

`vitconvert compare` answers it on demand; a finished run answers it once, on its own validation images,
so the run folder (compare.json, compare.png) and the model card (the per-layer table) say which layers
the student has not learned yet without a second command. Rank 0 only: it is a handful of batches.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from .. import data
from ..compare import compare_figure, compare_models, has_matplotlib
from ..public_names import shown_path
from ..recipes import Recipe
from ..writer import PNG_METADATA

COMPARE_JSON, COMPARE_PNG = "compare.json", "compare.png"


def sample_batches(dataset: Dataset, batches: int, batch_size: int, seed: int, workers: Any) -> Any:
    """A fixed random sample of the validation set (folders list their classes in order: no first-N)."""
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
    sample = Subset(dataset, chosen[:batches * batch_size].tolist())
    return data.make_loader(sample, batch_size, seed, train=False, workers=workers)  # type: ignore[arg-type]


def compare_at_end(student: nn.Module, *, teacher: nn.Module, teacher_spec: str, feed: data.RunData,
                   inp: data.InputConfig, recipe: Recipe, device: torch.device, folder: Path,
                   note: Callable[[str], None]) -> Optional[dict[str, Any]]:
    """Compare a device copy of ``student`` (the CPU eval model) with ``teacher`` (named ``teacher_spec``) on
    ``recipe.reporting.compare_batches`` batches of ``feed``'s validation set; write compare.json and, with matplotlib,
    compare.png into ``folder``; return ``CompareReport.to_dict()`` for the card. A failure is a ``note``, not
    an error: a diagnostic must not cost the trained model its folder."""

    try:
        on_device = copy.deepcopy(student).to(device).eval()
        batches = sample_batches(feed.val_set, recipe.reporting.compare_batches, feed.micro, recipe.seed,
                                 recipe.dataset.workers)
        report = compare_models(teacher, on_device, batches, inp)
        del on_device
        info = report.to_dict()
        about = {"teacher": teacher_spec, "data": recipe.dataset.data, "split": recipe.dataset.val_split}
        (folder / COMPARE_JSON).write_text(json.dumps({**info, **about}, indent=1) + "\n")
        if has_matplotlib():
            # push sends it: the teacher by its name, never a local folder's whole path (public_names)
            figure = compare_figure(report, title=f"{folder.name} vs {shown_path(teacher_spec)}")
            figure.savefig(folder / COMPARE_PNG, format="png", dpi=120, metadata=PNG_METADATA)
        return info
    except Exception as e:
        note(f"note: the end-of-run comparison with the teacher failed ({type(e).__name__}: {e}); "
             "the model is saved without it")
        return None
