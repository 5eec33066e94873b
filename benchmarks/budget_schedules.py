"""The schedules benchmarks/budget.py compares: each a name, what it does, and the recipe overrides it adds to the
quickstart recipe for an epoch budget and a regime ("paper" adds none: quickstart as shipped); a few also convert
with other variant options (CONVERT_OPTIONS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Overrides = dict[str, Any]
# Under every schedule: the quickstart recipe as every recorded run was made, before it moved to batch 32 at 6
# epochs (issue 38; that recipe is the schedule b32 at a 6-epoch budget), so the records keep their meaning.
BASE: Overrides = {"batch_size": 64}


def _attn_stage(epochs: int) -> Overrides:
    """Teacher-forced attention transfer for the first fifth of the budget (at least one epoch), then
    end-to-end; a 1-epoch budget has no room for two stages, so it trains jointly on teacher-forced targets."""
    if epochs < 2:
        return {"attn_target": "teacher-forced"}
    return {"attn_target": "teacher-forced", "stages": f"attn:{max(1, epochs // 5)},finetune"}


# optimizer steps an epoch at batch 32: 1500 train images in the same task, 747 in the transfer target (digits 5-9)
STEPS_B32 = {"same": 1500 // 32, "transfer": 747 // 32}


def _attn_steps(epochs: int, regime: str, share: float) -> Overrides:
    """Batch 32, a teacher-forced attention stage of ``share`` of the run's optimizer steps (counted in steps, at
    least one), then end-to-end: LoLCATs' attention transfer as a fixed fraction of any budget."""
    steps = max(1, round(share * epochs * STEPS_B32[regime]))
    return {"batch_size": 32, "attn_target": "teacher-forced", "stages": f"attn:{steps}steps,finetune"}


def _sqrt_lr(batch: int, lr: float = 2e-3, reference: int = 32) -> float:
    """The square-root rule from b32's lr: lr × √(batch / 32), rounded to 3 significant digits."""
    return float(f"{lr * (batch / reference) ** 0.5:.3g}")


def _kd(regime: str) -> Overrides:
    """Logit KD needs the teacher's classes: same task only (a transfer student's 5 classes are other digits)."""
    return {"kd_weight": 1.0} if regime == "same" else {}


# name -> (description, overrides for an epoch budget and a regime); "paper" is quickstart as shipped
SCHEDULES: dict[str, tuple[str, Callable[[int, str], Overrides]]] = {
    "paper": ("the quickstart recipe at batch 64 (as shipped until issue 38): joint, attention MSE on own inputs",
              lambda e, r: {}),
    "tf": ("joint, attention MSE on teacher-forced inputs", lambda e, r: {"attn_target": "teacher-forced"}),
    "tf-stage": ("teacher-forced attention stage (epochs // 5, at least 1), then end-to-end",
                 lambda e, r: _attn_stage(e)),
    "lr10": ("joint, fresh parameters at 10× lr", lambda e, r: {"new_params": {"lr_scale": 10}}),
    "kd": ("joint + logit KD (same task only)", lambda e, r: _kd(r)),
    "lr10-kd": ("fresh parameters at 10× lr + logit KD (same task only)",
                lambda e, r: {"new_params": {"lr_scale": 10}, **_kd(r)}),
    "fast": ("teacher-forced attention stage, fresh parameters at 10× lr, logit KD (same task only)",
             lambda e, r: {**_attn_stage(e), "new_params": {"lr_scale": 10}, **_kd(r)}),
    "new10": ("joint, fresh parameters at 10× lr, a fresh head at 1× (new_params.head_lr_scale; no head here is "
              "fresh: same as lr10)",
              lambda e, r: {"new_params": {"lr_scale": 10, "head_lr_scale": 1}}),
    "new3": ("joint, fresh attention parameters at 3× lr, a fresh head at 1×",
             lambda e, r: {"new_params": {"lr_scale": 3, "head_lr_scale": 1}}),
    "lr4": ("joint, peak lr 4e-3 (2×)", lambda e, r: {"lr": 4e-3}),
    "b32": ("joint, batch 32 (2× the optimizer steps; at 6 epochs: the quickstart recipe since issue 38)",
            lambda e, r: {"batch_size": 32}),
    "lr6": ("joint, peak lr 6e-3 (3×)", lambda e, r: {"lr": 6e-3}),
    "lr4-kd": ("peak lr 4e-3 + logit KD (same task only)", lambda e, r: {"lr": 4e-3, **_kd(r)}),
    "head3": ("joint, a fresh head at 3× lr", lambda e, r: {"new_params": {"head_lr_scale": 3}}),
    "head10": ("joint, a fresh head at 10× lr", lambda e, r: {"new_params": {"head_lr_scale": 10}}),
    "lr4-w0": ("peak lr 4e-3 from the first step (no warm-up)", lambda e, r: {"lr": 4e-3, "warmup_epochs": 0}),
    "lr4-crop1": ("peak lr 4e-3, crops of the whole image (scale 1)", lambda e, r: {"lr": 4e-3, "scale": [1, 1]}),
    "b32-tf10": ("batch 32, a teacher-forced attention stage of 1/10 of the optimizer steps, then end-to-end",
                 lambda e, r: _attn_steps(e, r, 0.1)),
    "b32-tf20": ("batch 32, a teacher-forced attention stage of 1/5 of the optimizer steps, then end-to-end",
                 lambda e, r: _attn_steps(e, r, 0.2)),
    "b32-new3": ("batch 32, fresh parameters at 3× lr", lambda e, r: {"batch_size": 32, "new_params": {"lr_scale": 3}}),
    "b32-hedgehog": ("batch 32, converted with Hedgehog's learned feature map (feature_map=hedgehog; elu, relu)",
                     lambda e, r: {"batch_size": 32}),
    "b32-hedgehog-s2": ("batch 32, Hedgehog's map started sharper: W = 2·I (feature_map=hedgehog, init_scale=2)",
                        lambda e, r: {"batch_size": 32}),
    "b32-ce": ("batch 32, Hedgehog's attention-weight cross-entropy instead of the attention-output MSE (attn_loss "
               "weight_ce)", lambda e, r: {"batch_size": 32, "attn_loss": "weight_ce"}),
    "b32-hedgehog-ce": ("b32-hedgehog (W = I) trained on the weight cross-entropy (attn_loss weight_ce)",
                        lambda e, r: {"batch_size": 32, "attn_loss": "weight_ce"}),
    "b32-hedgehog-s2-ce": ("b32-hedgehog-s2 (W = 2·I) trained on the weight cross-entropy (attn_loss weight_ce)",
                           lambda e, r: {"batch_size": 32, "attn_loss": "weight_ce"}),
    # the fifth pass (issue 38, same task at 5 epochs): one lever each on top of b16, its curves read first (under-fit)
    "b16-ls0": ("batch 16, no label smoothing (smoothing 0)", lambda e, r: {"batch_size": 16, "smoothing": 0.0}),
    "b16-wd0": ("batch 16, no weight decay", lambda e, r: {"batch_size": 16, "weight_decay": 0.0}),
    "b16-aw03": ("batch 16, attention loss weight 0.3", lambda e, r: {"batch_size": 16, "attn_weight": 0.3}),
    "b16-aw3": ("batch 16, attention loss weight 3", lambda e, r: {"batch_size": 16, "attn_weight": 3.0}),
    "b16-cos": ("batch 16, attention loss 1 − cosine instead of MSE",
                lambda e, r: {"batch_size": 16, "attn_loss": "cosine"}),
    "b16-ema": ("batch 16, evaluated on an EMA of the weights (timm's ModelEmaV3, decay 0.99: ~1 epoch)",
                lambda e, r: {"batch_size": 16, "ema": True, "ema_decay": 0.99}),
    "b16-crop1": ("batch 16, crops of the whole image (scale 1: on the 8×8 digits every crop is the whole image, so no "
                  "augmentation is left)", lambda e, r: {"batch_size": 16, "scale": [1, 1]}),
    "b16-hedgehog": ("batch 16, converted with Hedgehog's learned feature map (feature_map=hedgehog; elu, relu)",
                     lambda e, r: {"batch_size": 16}),
    "b16": ("joint, batch 16 (4× paper's optimizer steps), lr kept", lambda e, r: {"batch_size": 16}),
    "b8": ("joint, batch 8 (8× paper's optimizer steps), lr kept", lambda e, r: {"batch_size": 8}),
    "b16-sqrt": ("joint, batch 16, lr scaled from b32's by the square-root rule (2e-3 × √½ = 1.41e-3)",
                 lambda e, r: {"batch_size": 16, "lr": _sqrt_lr(16)}),
    "b8-sqrt": ("joint, batch 8, lr scaled from b32's by the square-root rule (2e-3 × √¼ = 1e-3)",
                lambda e, r: {"batch_size": 8, "lr": _sqrt_lr(8)}),
    "b32-w0": ("batch 32, peak lr from the first step (no warm-up: at 2 epochs the warm-up is half the run)",
               lambda e, r: {"batch_size": 32, "warmup_epochs": 0}),
    "b32-lr3": ("batch 32, peak lr 3e-3 (1.5×)", lambda e, r: {"batch_size": 32, "lr": 3e-3}),
    "b32-lr4": ("batch 32, peak lr 4e-3 (2×)", lambda e, r: {"batch_size": 32, "lr": 4e-3}),
    "b32-crop1": ("batch 32, crops of the whole image (scale 1: no augmentation on the 8×8 digits); at 6 epochs: "
                  "the quickstart recipe with whole-image crops", lambda e, r: {"batch_size": 32, "scale": [1, 1]}),
    "b16-lr3": ("batch 16, peak lr 3e-3 (1.5×)", lambda e, r: {"batch_size": 16, "lr": 3e-3}),
    "b16-lr4": ("batch 16, peak lr 4e-3 (2×)", lambda e, r: {"batch_size": 16, "lr": 4e-3}),
    "b16-new05": ("batch 16, fresh parameters (Mimetic attention, TTT's fast weights and convs) at 0.5× lr",
                  lambda e, r: {"batch_size": 16, "new_params": {"lr_scale": 0.5}}),
}
# schedule -> the variant options it converts with, on top of the variant's own (benchmarks/reproduce.py OPTIONS)
CONVERT_OPTIONS: dict[str, Overrides] = {"b32-hedgehog": {"feature_map": "hedgehog", "init_scale": 1.0},
                                         "b32-hedgehog-s2": {"feature_map": "hedgehog", "init_scale": 2.0},
                                         "b32-hedgehog-ce": {"feature_map": "hedgehog", "init_scale": 1.0},
                                         "b32-hedgehog-s2-ce": {"feature_map": "hedgehog", "init_scale": 2.0},
                                         "b16-hedgehog": {"feature_map": "hedgehog", "init_scale": 1.0}}

# schedule -> the schedule it changes one thing of, beside the ``base-*`` names: the paired tables set each
# against it (`--versus b32` compares b16 with b32 seed by seed)
DERIVED_FROM: dict[str, str] = {"b16": "b32", "b8": "b32", "b16-sqrt": "b32", "b8-sqrt": "b32"}
