"""A training recipe: YAML + command-line overrides -> one frozen, validated dataclass.

The recipe is data so that any run can be repeated: the run folder keeps the YAML text as given plus the
overrides (``recipe.yaml``), and the model card shows the resolved values. Field names follow timm's
train.py arguments where one exists (``reprob``, ``mixup``, ``smoothing``, ``clip_grad``...).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .errors import VitconvertError, first_line
from .recipe_checks import check_recipe, parse_stages

ATTN_LOSSES = ("mse", "cosine", "smooth_l1")
ATTN_TARGETS = ("own", "teacher-forced")
AMP_DTYPES = ("bfloat16", "float16")
# Fields that say where or how fast, not what is trained: changing them does not change a resumed run's result.
OPERATIONAL = frozenset({"data_dir", "download", "workers", "log_interval", "compare_batches", "schedule_scaled"})


@dataclass(frozen=True)
class NewParams:
    """How the weights ``convert`` initialised fresh (not copied) train: their own LR multiplier, weight decay
    and warmup, because they start far from any optimum while the copied ones start near one."""

    lr_scale: float = 1.0  # × the schedule's lr (× the layer-decay scale when layer_decay is on)
    weight_decay: Optional[float] = None  # None: the recipe's weight_decay (biases, norms, tokens: always 0)
    warmup_epochs: Optional[int] = None  # None: the recipe's warmup_epochs
    # A fresh (re-headed) classifier's own multiplier; None: lr_scale. The head sees the task loss directly and
    # overshoots at a scale that suits fresh attention (budget search, docs/results.md).
    head_lr_scale: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("lr_scale", "head_lr_scale"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise VitconvertError(f"recipe new_params.{name} must be positive (got {value})")
        for name in ("weight_decay", "warmup_epochs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise VitconvertError(f"recipe new_params.{name} must not be negative (got {value})")

    @classmethod
    def from_value(cls, value: Any) -> NewParams:
        """A mapping from YAML (every sub-key checked, as top-level keys are), or a NewParams."""
        if isinstance(value, NewParams):
            return value
        if not isinstance(value, dict):
            raise VitconvertError(f"recipe new_params: expected a mapping such as {{lr_scale: 10}}, got {value!r}")
        valid = {f.name: f for f in dataclasses.fields(cls)}
        for key in value:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(valid)}"
                raise VitconvertError(f"unknown recipe key new_params.{key}{hint}")
        hints = typing.get_type_hints(cls)
        return cls(**{k: _coerce_value(f"new_params.{k}", hints[k], v) for k, v in value.items()})


@dataclass(frozen=True)
class Recipe:
    """Every knob of a distill run. Defaults: the Xu et al. (2024) small-dataset recipe (method.md)."""

    name: str = "default"
    # -- data -------------------------------------------------------------------------------------
    data: Optional[str] = None  # image folder with train/ and val/, a timm dataset name (torch/cifar100), digits
    data_dir: Optional[str] = None  # root for timm dataset names
    download: bool = False
    train_split: str = "train"
    val_split: str = "validation"  # folders: val/, valid/ or validation/
    workers: Optional[int] = None  # DataLoader workers per process; None: up to 8, by the CPUs
    # -- input and augmentation (timm.data.create_transform, timm.data.Mixup) -------------------------
    img_size: Optional[int] = None  # None: the student's own input size
    interpolation: str = "bicubic"
    crop_pct: Optional[float] = None  # eval centre crop; None: the student's pretrained_cfg
    mean: Optional[tuple[float, ...]] = None  # None: the student's pretrained_cfg
    std: Optional[tuple[float, ...]] = None
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
    # -- optimisation (timm.optim, timm.scheduler) ---------------------------------------------------
    epochs: int = 300
    batch_size: int = 512  # global: per optimizer step, over all processes and accumulation steps
    accum_steps: int = 1
    opt: str = "adamw"
    lr: float = 2e-3
    weight_decay: float = 0.05
    momentum: float = 0.9
    clip_grad: Optional[float] = None
    clip_mode: str = "norm"
    sched: str = "cosine"
    min_lr: float = 1e-6
    warmup_epochs: int = 50
    warmup_lr: float = 1e-6
    sched_on_updates: bool = True  # the lr changes every optimizer step, not every epoch
    # When --epochs (or --set epochs=) changes a recipe's length, its warm-ups (and freeze_copied_epochs) scale
    # with it, keeping the recipe's proportions; false pins them at the values written (scale_schedule below).
    scale_schedule: bool = True
    schedule_scaled: Optional[str] = None  # set by load_recipe: what was scaled, shown at the run's start
    drop_path: Union[float, str] = "auto"  # auto: 0 for ViT-Tiny widths (<= 192), 0.1 for larger
    ema: bool = False
    ema_decay: float = 0.9998
    amp: bool = True  # autocast on CUDA only; CPU runs are float32
    amp_dtype: str = "bfloat16"
    seed: int = 0
    # -- distillation ---------------------------------------------------------------------------------
    attn_weight: float = 1.0
    attn_loss: str = "mse"
    attn_target: str = "own"  # own: each model on its own hidden states; teacher-forced: LoLCATs-style
    kd_weight: float = 0.0
    kd_temperature: float = 1.0
    stages: str = "joint"  # e.g. "attn:5,finetune": epochs per stage; stages without a count share the rest
    # -- parameter groups (distill/param_groups.py) -------------------------------------------------
    new_params: NewParams = NewParams()  # the freshly initialised weights' lr_scale, weight_decay, warmup_epochs
    freeze_copied_epochs: int = 0  # the copied weights do not change for this many first epochs
    layer_decay: Optional[float] = None  # layer-wise lr decay (timm param_groups_layer_decay), e.g. 0.75
    compare_batches: int = 4  # validation batches of the end-of-run teacher comparison (0: none)
    # -- logging ------------------------------------------------------------------------------------
    log_interval: int = 10  # optimizer steps between metrics.jsonl step records

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_counts()
        if not isinstance(self.new_params, NewParams):  # Recipe(new_params={...}) from Python
            object.__setattr__(self, "new_params", NewParams.from_value(self.new_params))
        self._check_schedule()
        object.__setattr__(self, "_plan", parse_stages(self.stages, self.epochs))  # parsed once, checked here
        check_recipe(self)  # ranges, and the names timm reads later, against timm's registries

    def _check_choices(self) -> None:
        """The string fields vitconvert reads itself, against their few valid values."""
        for name, value, valid in (("attn_loss", self.attn_loss, ATTN_LOSSES),
                                   ("attn_target", self.attn_target, ATTN_TARGETS),
                                   ("amp_dtype", self.amp_dtype, AMP_DTYPES),
                                   ("mixup_mode", self.mixup_mode, ("batch", "pair", "elem"))):
            if value not in valid:
                raise VitconvertError(f"recipe {name}: {value!r} is not one of {', '.join(valid)}")

    def _check_counts(self) -> None:
        for name in ("epochs", "batch_size", "accum_steps", "recount", "log_interval"):
            if getattr(self, name) < 1:
                raise VitconvertError(f"recipe {name} must be at least 1 (got {getattr(self, name)})")
        if self.batch_size % self.accum_steps:
            raise VitconvertError(f"recipe batch_size {self.batch_size} is not divisible by accum_steps "
                                  f"{self.accum_steps}")
        if self.drop_path != "auto" and not (isinstance(self.drop_path, float) and 0 <= self.drop_path < 1):
            raise VitconvertError(f"recipe drop_path must be 'auto' or a number in [0, 1) (got {self.drop_path!r})")
        if self.img_size is not None and self.img_size < 1:
            raise VitconvertError(f"recipe img_size must be positive (got {self.img_size})")
        if self.kd_temperature <= 0:
            raise VitconvertError(f"recipe kd_temperature must be positive (got {self.kd_temperature})")

    def _check_schedule(self) -> None:
        """Warm-ups and frozen epochs inside the run, layer decay a factor, the comparison a count."""
        for name, warmup in (("warmup_epochs", self.warmup_epochs),
                             ("new_params.warmup_epochs", self.new_params.warmup_epochs)):
            if warmup is not None and warmup >= self.epochs and warmup > 0:
                raise VitconvertError(f"recipe {name} ({warmup}) must be below epochs ({self.epochs}): the lr "
                                      "would never leave warm-up (set scale_schedule: true, or a shorter warm-up)")
        if not 0 <= self.freeze_copied_epochs <= self.epochs:
            raise VitconvertError(f"recipe freeze_copied_epochs must be between 0 and epochs ({self.epochs}) "
                                  f"(got {self.freeze_copied_epochs})")
        if self.layer_decay is not None and not 0 < self.layer_decay <= 1:
            raise VitconvertError(f"recipe layer_decay must be in (0, 1] or null (got {self.layer_decay})")
        if self.compare_batches < 0:
            raise VitconvertError(f"recipe compare_batches must not be negative (got {self.compare_batches})")

    def stage_plan(self) -> list[tuple[str, int]]:
        """[(stage, epochs)] summing to ``epochs``: "attn:5,finetune" -> [("attn", 5), ("finetune", epochs-5)]."""
        return list(self._plan)  # type: ignore[attr-defined]

    def stage_at(self, epoch: int) -> str:
        """The stage that trains epoch ``epoch`` (0-based)."""
        end = 0
        for name, epochs in self._plan:  # type: ignore[attr-defined]
            end += epochs
            if epoch < end:
                return name
        return self._plan[-1][0]  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def resolved_drop_path(self, width: int) -> float:
        if self.drop_path == "auto":
            return 0.0 if width <= 192 else 0.1
        return float(self.drop_path)


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
HINTS = typing.get_type_hints(Recipe)


def coerce(key: str, value: Any) -> Any:
    """``value`` checked against the field's type (ints accepted for floats, lists for tuples)."""
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise VitconvertError(f"unknown recipe key {key!r}{hint}")
    return _coerce_value(key, HINTS[key], value)


def _coerce_value(key: str, hint: Any, value: Any) -> Any:
    args = typing.get_args(hint)
    if hint is NewParams:
        return NewParams.from_value({} if value is None else value)
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


def recipe_dirs() -> list[Path]:
    """Where named recipes live: ``vitconvert/recipe_files``, a link to the repository's recipes/ that
    wheels ship as real files, so `--recipe cifar100` works in a checkout and in an installed package alike."""
    packaged = Path(__file__).resolve().parent / "recipe_files"
    return [packaged] if packaged.is_dir() else []


def available_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})


def find_recipe(spec: str) -> Path:
    """A recipe file: a path, or a name in recipes/ (``cifar100`` -> recipes/cifar100.yaml)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    for folder in recipe_dirs():
        candidate = folder / f"{spec.removesuffix('.yaml')}.yaml"
        if candidate.is_file():
            return candidate
    names = ", ".join(available_recipes()) or "none installed"
    raise VitconvertError(f"recipe not found: {spec} (a YAML file, or one of: {names})")


def parse_recipe_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        reason = first_line(e)
        raise VitconvertError(f"{where} is not valid YAML ({reason})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise VitconvertError(f"{where} must be a mapping of recipe keys to values")
    return data


def build_recipe(values: dict[str, Any]) -> Recipe:
    """A recipe from YAML-style values over the defaults; the default warm-up scales to a shorter ``epochs``."""
    values = nest_overrides(scale_schedule({}, values), {})
    return Recipe(**{k: coerce(str(k), v) for k, v in values.items()})


def overrides_text(overrides: dict[str, Any]) -> str:
    if not overrides:
        return ""
    body = yaml.safe_dump(overrides, sort_keys=False, default_flow_style=False).strip()
    return f"\n# overrides from the command line (later keys win)\n{body}\n"


def nest_overrides(overrides: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``new_params.lr_scale=10`` -> ``new_params: {…the file's sub-keys…, lr_scale: 10}``: a mapping override
    merges into the file's mapping, and is stored whole, so re-reading recipe.yaml (last key wins) is the same."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        head, dot, sub = str(key).partition(".")
        if dot:
            key, value = head, {sub: value}
        base = out.get(key, values.get(key))
        if isinstance(value, dict) and isinstance(base, dict):
            value = {**base, **value}
        out[key] = value
    return out


def load_recipe(spec: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> tuple[Recipe, str]:
    """(recipe, text to store): the file's text as written plus the overrides, which YAML reads last-wins."""
    if spec is None:
        values: dict[str, Any] = {}
        text = "# vitconvert's default recipe (no --recipe given)\n" + yaml.safe_dump(
            Recipe().to_dict(), sort_keys=False)
    else:
        path = find_recipe(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise VitconvertError(f"{path} is not a recipe: a recipe is YAML text, and this file is binary (not "
                                  f"UTF-8 at byte {e.start})") from None
        values = parse_recipe_text(text, str(path))
        values.setdefault("name", path.stem)
    overrides = nest_overrides(scale_schedule(values, overrides or {}), values)
    recipe = build_recipe({**values, **overrides})
    text = text if text.endswith("\n") else text + "\n"
    return recipe, text + overrides_text(overrides)


SCALED_WITH_EPOCHS = ("warmup_epochs", "new_params.warmup_epochs", "freeze_copied_epochs")


def scale_schedule(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` plus the epoch counts (warm-ups, frozen epochs) scaled to the run's ``epochs``.

    Each count keeps its proportion of the epochs it was written for: a recipe file's own ``epochs`` for the
    values the file sets, the built-in 300 for the defaults. A 300-epoch recipe run for 15 epochs would otherwise
    spend them all in its 50-epoch warm-up and never reach its peak lr or its cosine. Values the overrides set
    are kept, as is everything when ``scale_schedule`` is false. The scaled values are written as overrides,
    so recipe.yaml re-reads the same.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(Recipe)}
    given = set(overrides) | {f"{k}.{sub}" for k, v in overrides.items() if isinstance(v, dict) for sub in v}
    in_file = set(values) | {f"new_params.{sub}" for sub in (values.get("new_params") or {})}
    written = {**defaults, **values}
    fresh = {**asdict(NewParams()), **(values.get("new_params") or {})}
    epochs = overrides.get("epochs", written["epochs"])
    if not overrides.get("scale_schedule", written["scale_schedule"]) or not _count(epochs):
        return overrides
    out, notes = dict(overrides), []
    for key in SCALED_WITH_EPOCHS:
        value = fresh.get(key.partition(".")[2]) if key.startswith("new_params.") else written.get(key)
        base = written["epochs"] if key in in_file else defaults["epochs"]
        if key in given or not _count(value) or not _count(base) or base == epochs:
            continue
        out[key] = round(value * epochs / base)
        notes.append(f"{key} {value} -> {out[key]} (written for {base} epochs)")
    if notes:
        out["schedule_scaled"] = f"to {epochs} epochs: " + ", ".join(notes)
    return out


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
