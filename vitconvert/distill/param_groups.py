"""Parameter groups for new weights: what ``convert`` initialised fresh trains apart from what it copied.

Copied weights start near a good solution, fresh ones (Mimetic or random attention, the extra MHLA/TTT
parameters, a new head) start far from one; as in the TTT linearization peer (LeapLabTHU/Transformer-to-TTT),
the recipe can give the fresh ones their own LR multiplier, weight decay and warmup (``new_params``) and can
hold the copied ones still while the fresh ones catch up (``freeze_copied_epochs``). Which weights are fresh
comes from the conversion report: the per-parameter actions are recomputed from the recorded init recipe
(``init.parameter_actions``) and must add up to the recorded per-group counts, so folders written before
this module existed work and a grouping that drifted from the report is refused rather than trusted.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..errors import VitconvertError
from ..init import InitRecipe, parameter_actions
from ..provenance import report_of
from ..recipes import NewParams, Recipe
from .checkpoint import json_only

FRESH_ACTIONS = ("mimetic", "default-init", "random")  # everything but "copied"


def _report(model: nn.Module) -> dict[str, Any]:
    report = report_of(model)
    if not isinstance(report.get("init"), dict) or not isinstance(report.get("groups"), list):
        raise VitconvertError("new_params and freeze_copied_epochs need the conversion report (the \"init\" and "
                              "\"groups\" of config.json's vitconvert block), which this student lacks: convert "
                              "it again with `vitconvert convert`")
    return report


def parameter_origins(model: nn.Module) -> dict[str, tuple[str, str]]:
    """name -> (report group, init action) of every parameter of a converted ``model``, checked against its report."""
    report = _report(model)
    try:
        recipe = InitRecipe(**report["init"])
    except TypeError as e:
        raise VitconvertError(f"the conversion report's init recipe {report['init']} is not readable ({e})") from None
    recorded = {(row["group"], row["action"]): (row["tensors"], row["params"]) for row in report["groups"]}
    # The report records counts, not whether the head was replaced: a random head under `rest: copy` says it was.
    reheaded = recipe.rest == "copy" and ("head", "random") in recorded
    actions = parameter_actions(model, recipe, reheaded)
    counted: dict[tuple[str, str], list[int]] = {}
    for name, param in model.named_parameters():
        count = counted.setdefault(actions[name], [0, 0])
        count[0] += 1
        count[1] += param.numel()
    if {k: tuple(v) for k, v in counted.items()} != recorded:
        raise VitconvertError("the student's parameters do not match its conversion report (recorded "
                              f"{sorted(recorded.items())}, found {sorted(counted.items())}): cannot tell the "
                              "copied weights from the fresh ones; convert the model again")
    return actions


def fresh_parameter_names(model: nn.Module, group: Optional[str] = None) -> set[str]:
    """The parameters ``convert`` did not copy (mimetic, default-init or random), of one report group if given."""
    return {name for name, (g, action) in parameter_origins(model).items()
            if action in FRESH_ACTIONS and group in (None, g)}


def split_groups(model: nn.Module, recipe: Recipe, fresh: set[str], head: frozenset[str] = frozenset()
                 ) -> list[dict[str, Any]]:
    """timm's groups (weight decay, and layer decay when set), each split into its copied and fresh parameters.

    Every group carries ``kind`` ("copied" or "new") and ``lr_scale`` (the layer scale × new_params.lr_scale),
    which timm's schedulers multiply into each group's lr. Weight decay applies to what timm decays (not biases,
    norms, tokens), at ``new_params.weight_decay`` for fresh parameters. The fresh ``head`` parameters (a new
    classifier) get groups of their own at ``new_params.head_lr_scale`` when it is set.
    """
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    skip = getattr(model, "no_weight_decay", lambda: set())()
    # weight_decay 1.0 only marks the decayed groups: timm merges everything into one group at 0
    o = recipe.optimization
    if o.layer_decay is not None:
        base = param_groups_layer_decay(model, weight_decay=1.0, no_weight_decay_list=skip,
                                        layer_decay=o.layer_decay)
    else:
        base = param_groups_weight_decay(model, weight_decay=1.0, no_weight_decay_list=skip)
    new = o.new_params
    origin = {id(p): "head" if name in head else "new" if name in fresh else "copied"
              for name, p in model.named_parameters()}
    groups = []
    for group in base:
        decayed = group["weight_decay"] > 0
        for kind in ("copied", "new", "head"):
            params = [p for p in group["params"] if origin[id(p)] == kind]
            if not params:
                continue
            scale, decay = group.get("lr_scale", 1.0), o.weight_decay
            if kind != "copied":
                scale *= new.lr_scale if kind == "new" or new.head_lr_scale is None else new.head_lr_scale
                decay = o.weight_decay if new.weight_decay is None else new.weight_decay
            groups.append({**group, "params": params, "kind": "copied" if kind == "copied" else "new",
                           "lr_scale": scale, "weight_decay": decay if decayed else 0.0})
    return groups


class GroupView(torch.optim.Optimizer):
    """One kind of an optimizer's param groups, for a timm scheduler of their own (timm reads only param_groups).

    Looked up on every access: loading a checkpoint replaces the optimizer's group dicts with new ones.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str):  # no super().__init__: no params of its own
        self.optimizer, self.kind, self.defaults = optimizer, kind, optimizer.defaults

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """Only the groups of this view's kind, so timm's scheduler steps those alone."""
        return [g for g in self.optimizer.param_groups if g.get("kind") == self.kind]


class SplitScheduler:
    """Two timm schedulers, copied and fresh groups, differing in warmup only; the trainer's scheduler API."""

    def __init__(self, schedulers: dict[str, Any]):
        self.schedulers = schedulers

    def step(self, epoch: int, metric: Optional[float] = None) -> None:
        """Step every group's schedule at an epoch's end."""
        for s in self.schedulers.values():
            s.step(epoch, metric)

    def step_update(self, num_updates: int, metric: Optional[float] = None) -> None:
        """Step every group's schedule after an optimizer update."""
        for s in self.schedulers.values():
            s.step_update(num_updates, metric)

    def state_dict(self) -> dict[str, Any]:

        """Each schedule's state, JSON-only, for trainer.json."""
        return {k: json_only(s.state_dict()) for k, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put each schedule back where a checkpoint left it."""
        for k, s in self.schedulers.items():
            s.load_state_dict(state[k])


FUSED_ON_CPU = ("adam", "adamw")  # timm's names of the torch optimizers with a fused CPU step


def create_optimization(model: nn.Module, recipe: Recipe, updates_per_epoch: int) -> tuple[Any, Any]:
    """(optimizer, scheduler) per the recipe: timm's, over split groups when fresh weights train differently."""
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    o, s = recipe.optimization, recipe.schedule
    args: dict[str, Any] = dict(opt=o.opt, lr=s.lr, weight_decay=o.weight_decay, momentum=o.momentum)
    if o.opt.lower() in FUSED_ON_CPU and all(p.device.type == "cpu" for p in model.parameters()):
        args["fused"] = True  # torch's CPU default is a Python loop over the tensors: ~6x the fused step's time
    if o.new_params == NewParams():  # one kind of weight: timm's own groups, as before new_params existed
        optimizer = create_optimizer_v2(model, layer_decay=o.layer_decay, **args)
    else:
        fresh = fresh_parameter_names(model)
        own_head = o.new_params.head_lr_scale is not None
        head = frozenset(fresh_parameter_names(model, "head") if own_head else ())
        optimizer = create_optimizer_v2(model, param_group_fn=lambda m: split_groups(m, recipe, fresh, head), **args)

    def schedule(target: torch.optim.Optimizer, warmup_epochs: int) -> Any:
        # Warm-up first, then the whole cosine from the peak lr down to min_lr by the last epoch, as the
        # reference code's cosine_scheduler does (timm's default would start the cosine under the warm-up,
        # so the peak lr is never reached).
        return create_scheduler_v2(target, sched=s.sched, num_epochs=s.epochs - warmup_epochs, min_lr=s.min_lr,
                                   warmup_lr=s.warmup_lr, warmup_epochs=warmup_epochs, warmup_prefix=True,
                                   step_on_epochs=not s.sched_on_updates, updates_per_epoch=updates_per_epoch)[0]

    warmup = o.new_params.warmup_epochs
    if warmup is None or warmup == s.warmup_epochs:
        return optimizer, schedule(optimizer, s.warmup_epochs)
    kinds = {g["kind"] for g in optimizer.param_groups}
    schedulers = {kind: schedule(GroupView(optimizer, kind), s.warmup_epochs if kind == "copied" else warmup)
                  for kind in ("copied", "new") if kind in kinds}
    return optimizer, SplitScheduler(schedulers)


def frozen_ids(model: nn.Module, recipe: Recipe) -> set[int]:
    """The copied parameters ``freeze_copied_epochs`` holds still (none when it is 0)."""
    if recipe.schedule.freeze_copied_epochs == 0:
        return set()
    fresh = fresh_parameter_names(model)
    return {id(p) for name, p in model.named_parameters() if name not in fresh}


def logged_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The schedule's lr, the largest over copied groups (layer decay scales the lower layers down), and
    ``lr_new``, the largest over fresh-weight groups, when they have groups of their own."""
    groups = optimizer.param_groups
    copied = [g for g in groups if g.get("kind") != "new"] or groups
    out = {"lr": max(float(g["lr"]) for g in copied)}
    new = [g for g in groups if g.get("kind") == "new"]
    if new:
        out["lr_new"] = max(float(g["lr"]) for g in new)
    return out
