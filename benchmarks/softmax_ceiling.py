"""The softmax ceiling of benchmarks/budget.py: the source teacher itself, fine-tuned the way students are.

``distill`` trains linear students only (a softmax STUDENT is refused: there is no attention to distil), so the
ceiling is trained here, by the same pieces distill's loop uses: the recipe (quickstart plus the schedule's
overrides), its data pipeline (``data.run_data``: same order, same augmentation per image and epoch), timm's
optimizer and warm-up + cosine schedule (``param_groups.create_optimization``), the task loss
(``losses.task_criterion``), gradient clipping and the same evaluation. A head of another class count is
replaced as ``convert --num-classes`` replaces it (timm's own init at the run's seed); the digits transfer
source already has 5 classes, so there it keeps its head, as the students do. Only the task loss trains it
(nothing to distil: it *is* the teacher's architecture). Not a user feature, so it stays in benchmarks/.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch


def finetune_softmax(source: str, overrides: dict[str, Any], num_classes: Optional[int]) -> dict[str, Any]:
    """Fine-tune the softmax model ``source`` with recipe quickstart + ``overrides``: final val metrics."""
    from timm.utils import dispatch_clip_grad

    from vitconvert import data
    from vitconvert.conversion import fresh_like
    from vitconvert.distill.checkpoint import seed_everything
    from vitconvert.distill.losses import task_criterion
    from vitconvert.distill.models import set_drop_path
    from vitconvert.distill.param_groups import create_optimization
    from vitconvert.evaluate import eval_sums, metrics_from_sums
    from vitconvert.recipes import load_recipe
    from vitconvert.sources import load_source

    recipe, _ = load_recipe("quickstart", {**overrides, "attn_weight": 0.0, "kd_weight": 0.0})
    if recipe.stages != "joint" or recipe.attn_target != "own":
        raise SystemExit("the softmax ceiling trains jointly on the task loss only (no attention to distil)")
    model = load_source(source).model
    if num_classes is not None and num_classes != model.num_classes:  # as convert re-heads: timm's init, seeded
        model.reset_classifier(num_classes)
        model.head.load_state_dict(fresh_like(model, recipe.seed, num_classes=num_classes).head.state_dict())
    set_drop_path(model, recipe.optimization.resolved_drop_path(model.embed_dim))
    device = torch.device("cpu")
    inp = data.input_config(model, recipe)
    feed = data.run_data(recipe, inp, int(model.num_classes), 0, 1, False)
    optimizer, scheduler = create_optimization(model, recipe, feed.updates_per_epoch)
    criterion = task_criterion(recipe, mixup_active=False)
    seed_everything(recipe.seed)
    start, step = time.perf_counter(), 0
    for epoch in range(recipe.epochs):
        data.set_epoch(feed.train, epoch, 0)
        model.train()
        for batch, (images, targets) in enumerate(feed.train):
            if batch >= feed.micro_per_epoch:
                break
            criterion(model(images).float(), targets).backward()
            if recipe.clip_grad:
                dispatch_clip_grad(list(model.parameters()), recipe.clip_grad, mode=recipe.clip_mode)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            scheduler.step_update(num_updates=step)
        scheduler.step(epoch + 1)
    model.eval()
    metrics = metrics_from_sums(eval_sums(model, feed.val, device, recipe.amp, False, recipe.amp_dtype),
                                model.num_classes)
    return {**metrics, "seconds": time.perf_counter() - start}
