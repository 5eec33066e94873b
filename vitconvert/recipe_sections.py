"""The sections of a recipe: each a frozen dataclass that coerces and checks its own fields once, when built.

A field's name is the same as in the flat recipe that came before the sections (``epochs``, ``lr``, ``reprob``), and
unique across sections, so a flat key still says which section it belongs to (``recipes.FLAT_KEYS``) and an error
names the field as the user wrote it. Names follow timm's train.py arguments where one exists. A field marked
``OPERATIONAL`` says where or how fast, not what is trained: changing it does not change a resumed run's result.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypeVar, Union

from . import recipe_checks as rules
from .errors import VitconvertError

OPERATIONAL = {"operational": True}  # dataclass field metadata
AMP_DTYPES = ("bfloat16", "float16")
ATTN_LOSSES = ("mse", "cosine", "smooth_l1", "weight_ce")  # weight_ce: distill/attention_weights.py
ATTN_TARGETS = ("own", "teacher-forced")
MIXUP_MODES = ("batch", "pair", "elem")
S = TypeVar("S", bound="Section")


class Section:
    """What every section shares: values coerced to the field types (ints for floats, lists for tuples), every
    number finite, then the section's own ``check``. ``LABEL`` prefixes the field names in messages."""

    LABEL: ClassVar[str] = ""
    EXAMPLE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _coerce(self.LABEL + f.name, hints[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            rules.check_finite(self.LABEL + f.name, value)
        self.check()

    def check(self) -> None:
        """The section's own rules (ranges, choices, names timm reads)."""

    @classmethod
    def from_value(cls: type[S], value: Any, where: str) -> S:
        """A mapping of this section's keys (each checked, a typo with a suggestion), or an instance; None: defaults."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            example = cls.EXAMPLE or f"{{{dataclasses.fields(cls)[0].name}: ...}}"  # type: ignore[arg-type]
            raise VitconvertError(f"recipe {where}: expected a mapping such as {example}, got {value!r}")
        valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in value:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(valid)}"
                raise VitconvertError(f"unknown recipe key {where}.{key}{hint}")
        return cls(**value)

    def operational(self) -> set[str]:
        return {f.name for f in dataclasses.fields(self) if f.metadata.get("operational")}  # type: ignore[arg-type]


@dataclass(frozen=True)
class Dataset(Section):
    """Where the images come from."""

    data: Optional[str] = None  # image folder with train/ and val/, a timm dataset name (torch/cifar100), digits
    data_dir: Optional[str] = field(default=None, metadata=OPERATIONAL)  # root for timm dataset names
    download: bool = field(default=False, metadata=OPERATIONAL)
    train_split: str = "train"
    val_split: str = "validation"  # folders: val/, valid/ or validation/
    workers: Optional[int] = field(default=None, metadata=OPERATIONAL)  # DataLoader workers per process; None: <= 8

    def check(self) -> None:
        rules.check_not_negative("workers", self.workers)


@dataclass(frozen=True)
class Input(Section):
    """The input size and normalisation (timm's resolve_data_config); None: the student's pretrained_cfg."""

    img_size: Optional[int] = None  # None: the student's own input size
    interpolation: str = "bicubic"
    crop_pct: Optional[float] = None  # eval centre crop
    mean: Optional[tuple[float, ...]] = None
    std: Optional[tuple[float, ...]] = None

    def check(self) -> None:
        if self.img_size is not None and self.img_size < 1:
            raise VitconvertError(f"recipe img_size must be positive (got {self.img_size})")
        if self.crop_pct is not None and not 0 < self.crop_pct <= 1:
            raise rules.fail("crop_pct", self.crop_pct, "must be in (0, 1]")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None and len(value) not in (1, 3):
                raise rules.fail(name, list(value), "must have 1 or 3 values (one per channel)")
        if self.std is not None and min(self.std) <= 0:
            raise rules.fail("std", list(self.std), "must be positive")
        rules.check_interpolation(self.interpolation)


@dataclass(frozen=True)
class Augmentation(Section):
    """Training augmentation: timm.data.create_transform, RandomErasing and Mixup, and label smoothing."""

    no_aug: bool = False
    scale: tuple[float, ...] = (0.08, 1.0)  # RandomResizedCrop area range
    hflip: float = 0.5
    color_jitter: Optional[float] = 0.4
    rand_augment: Optional[str] = "rand-m9-mstd0.5-inc1"
    reprob: float = 0.25
    remode: str = "pixel"
    recount: int = 1
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    smoothing: float = 0.1

    def check(self) -> None:
        rules.check_choice("mixup_mode", self.mixup_mode, MIXUP_MODES)
        rules.check_at_least_one("recount", self.recount)
        for name in ("hflip", "reprob", "mixup_prob", "mixup_switch_prob"):
            rules.check_probability(name, getattr(self, name))
        if not 0 <= self.smoothing < 1:
            raise rules.fail("smoothing", self.smoothing, "must be in [0, 1) (label smoothing)")
        for name in ("color_jitter", "mixup", "cutmix"):
            rules.check_not_negative(name, getattr(self, name))
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1]:
            raise rules.fail("scale", list(self.scale), "must be [min, max] with 0 < min <= max (RandomResizedCrop "
                                                        "area range)")
        if self.remode not in rules.REMODES:
            raise rules.one_of("remode", self.remode, rules.REMODES)
        if self.rand_augment:
            rules.check_augment(self.rand_augment)


@dataclass(frozen=True)
class NewParams(Section):
    """How the weights ``convert`` initialised fresh (not copied) train: their own LR multiplier, weight decay
    and warmup, because they start far from any optimum while the copied ones start near one."""

    LABEL: ClassVar[str] = "new_params."
    EXAMPLE: ClassVar[str] = "{lr_scale: 10}"

    lr_scale: float = 1.0  # × the schedule's lr (× the layer-decay scale when layer_decay is on)
    weight_decay: Optional[float] = None  # None: the recipe's weight_decay (biases, norms, tokens: always 0)
    warmup_epochs: Optional[int] = None  # None: the recipe's warmup_epochs
    # A fresh (re-headed) classifier's own multiplier; None: lr_scale. The head sees the task loss directly and
    # overshoots at a scale that suits fresh attention (budget search, docs/results.md).
    head_lr_scale: Optional[float] = None

    def check(self) -> None:
        for name in ("lr_scale", "head_lr_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise VitconvertError(f"recipe new_params.{name} must be positive (got {value})")
        for name in ("weight_decay", "warmup_epochs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise VitconvertError(f"recipe new_params.{name} must not be negative (got {value})")


@dataclass(frozen=True)
class Optimization(Section):
    """The optimizer (timm.optim), its batch, clipping, precision, regularisation and parameter groups."""

    opt: str = "adamw"
    batch_size: int = 512  # global: per optimizer step, over all processes and accumulation steps
    accum_steps: int = 1
    weight_decay: float = 0.05
    momentum: float = 0.9
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    layer_decay: Optional[float] = None  # layer-wise lr decay (timm param_groups_layer_decay), e.g. 0.75
    new_params: NewParams = field(default_factory=NewParams)  # the fresh weights: lr_scale, weight_decay, warmup
    drop_path: Union[float, str] = "auto"  # auto: 0 for ViT-Tiny widths (<= 192), 0.1 for larger
    ema: bool = False
    ema_decay: float = 0.9998
    amp: bool = True  # autocast on CUDA only; CPU runs are float32
    amp_dtype: str = "bfloat16"

    def check(self) -> None:
        rules.check_choice("amp_dtype", self.amp_dtype, AMP_DTYPES)
        for name in ("batch_size", "accum_steps"):
            rules.check_at_least_one(name, getattr(self, name))
        if self.batch_size % self.accum_steps:
            raise VitconvertError(f"recipe batch_size {self.batch_size} is not divisible by accum_steps "
                                  f"{self.accum_steps}")
        if self.drop_path != "auto" and not (isinstance(self.drop_path, float) and 0 <= self.drop_path < 1):
            raise VitconvertError(f"recipe drop_path must be 'auto' or a number in [0, 1) (got {self.drop_path!r})")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise VitconvertError(f"recipe layer_decay must be in (0, 1] or null (got {self.layer_decay})")
        rules.check_probability("momentum", self.momentum)
        rules.check_probability("ema_decay", self.ema_decay)
        rules.check_not_negative("weight_decay", self.weight_decay)
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise rules.fail("clip_grad", self.clip_grad, "must be positive, or null for no clipping")
        if self.clip_mode not in rules.CLIP_MODES:
            raise rules.one_of("clip_mode", self.clip_mode, rules.CLIP_MODES)
        rules.check_optimizer(self.opt)

    def resolved_drop_path(self, width: int) -> float:
        if self.drop_path == "auto":
            return 0.0 if width <= 192 else 0.1
        return float(self.drop_path)


@dataclass(frozen=True)
class Schedule(Section):
    """The run's length and its learning rate over time (timm.scheduler), and what each epoch trains."""

    epochs: int = 300
    stages: str = "joint"  # "attn:5,finetune" (epochs) or "attn:300steps,finetune"; uncounted stages share the rest
    lr: float = 2e-3
    min_lr: float = 1e-6
    warmup_lr: float = 1e-6
    warmup_epochs: int = 50
    sched: str = "cosine"
    sched_on_updates: bool = True  # the lr changes every optimizer step, not every epoch
    freeze_copied_epochs: int = 0  # the copied weights do not change for this many first epochs
    # When the epochs are overridden (--epochs), the warm-ups and freeze_copied_epochs scale with them, keeping
    # the recipe's proportions; false pins them at the values written (recipes.scale_schedule).
    scale_schedule: bool = True
    schedule_scaled: Optional[str] = field(default=None, metadata=OPERATIONAL)  # what was scaled, said at the start

    def check(self) -> None:
        rules.check_at_least_one("epochs", self.epochs)
        if self.lr <= 0:
            raise rules.fail("lr", self.lr, "must be a positive number")
        for name in ("min_lr", "warmup_lr", "warmup_epochs"):
            rules.check_not_negative(name, getattr(self, name))
        if self.min_lr > self.lr:
            raise rules.fail("min_lr", self.min_lr, f"is above the peak lr ({self.lr})")
        check_warmup("warmup_epochs", self.warmup_epochs, self.epochs)
        if not 0 <= self.freeze_copied_epochs <= self.epochs:
            raise VitconvertError(f"recipe freeze_copied_epochs must be between 0 and epochs ({self.epochs}) "
                                  f"(got {self.freeze_copied_epochs})")
        rules.check_scheduler(self.sched)
        object.__setattr__(self, "_plan", rules.parse_stages(self.stages, self.epochs))  # parsed once, here

    def stage_names(self) -> tuple[str, ...]:
        """The stages in order: "attn:5,finetune" -> ("attn", "finetune")."""
        return tuple(name for name, *_ in self._plan)  # type: ignore[attr-defined]

    def stage_steps(self, updates_per_epoch: int) -> tuple[tuple[str, int], ...]:
        """((stage, optimizer steps), ...) summing to the run's steps: "attn:60steps,finetune" at 5 epochs of 46
        steps -> (("attn", 60), ("finetune", 170)); an error when the counts in steps do not fit."""
        return rules.stage_steps(self.stages, self._plan, self.epochs, updates_per_epoch)  # type: ignore[attr-defined]


def check_warmup(name: str, warmup: Optional[int], epochs: int) -> None:
    if warmup is not None and warmup >= epochs and warmup > 0:
        raise VitconvertError(f"recipe {name} ({warmup}) must be below epochs ({epochs}): the lr would never "
                              "leave warm-up (set scale_schedule: true, or a shorter warm-up)")


@dataclass(frozen=True)
class Distillation(Section):
    """What the student learns from the teacher: attention outputs and, optionally, logits."""

    attn_weight: float = 1.0
    attn_loss: str = "mse"
    attn_target: str = "own"  # own: each model on its own hidden states; teacher-forced: LoLCATs-style
    kd_weight: float = 0.0
    kd_temperature: float = 1.0

    def check(self) -> None:
        rules.check_choice("attn_loss", self.attn_loss, ATTN_LOSSES)
        rules.check_choice("attn_target", self.attn_target, ATTN_TARGETS)
        if self.kd_temperature <= 0:
            raise VitconvertError(f"recipe kd_temperature must be positive (got {self.kd_temperature})")
        rules.check_not_negative("attn_weight", self.attn_weight)
        rules.check_not_negative("kd_weight", self.kd_weight)


@dataclass(frozen=True)
class Reporting(Section):
    """What the run writes besides checkpoints: metrics.jsonl's step records, the end-of-run comparison."""

    log_interval: int = field(default=10, metadata=OPERATIONAL)  # optimizer steps between step records
    compare_batches: int = field(default=4, metadata=OPERATIONAL)  # validation batches compared (0: none)

    def check(self) -> None:
        rules.check_at_least_one("log_interval", self.log_interval)
        if self.compare_batches < 0:
            raise VitconvertError(f"recipe compare_batches must not be negative (got {self.compare_batches})")


# -- coercion: a YAML value checked against a field's type -------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` (ints accepted for floats, lists for tuples), or a one-line error."""
    if isinstance(hint, type) and issubclass(hint, Section):
        return hint.from_value(value, key)
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise VitconvertError(f"recipe {key} cannot be null")
    options = [a for a in args if a is not type(None)] if typing.get_origin(hint) is Union else [hint]
    for option in options:
        if _fits(option, value):
            return _as_type(option, value)
    names = " or ".join(getattr(o, "__name__", str(o)).replace("tuple", "list of numbers") for o in options)
    raise VitconvertError(f"recipe {key}: expected {names}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits(option: Any, value: Any) -> bool:
    """Whether a YAML value is of the field type ``option`` (no bool for a number; an int for a float)."""
    if option in (bool, str):
        return isinstance(value, option)
    if option is int:
        return _is_number(value) and isinstance(value, int)
    if option is float:
        return _is_number(value)
    return typing.get_origin(option) is tuple and isinstance(value, (list, tuple)) and all(map(_is_number, value))


def _as_type(option: Any, value: Any) -> Any:
    if option is float:
        return float(value)
    if typing.get_origin(option) is tuple:
        return tuple(float(v) for v in value)
    return value
