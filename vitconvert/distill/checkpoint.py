"""checkpoint-last/: everything a run needs to continue bit-for-bit, written atomically, never unpickled.

Tensors (model, EMA, optimizer state, torch RNG states) go to safetensors; the rest (position, recipe,
optimizer param groups, scheduler, scaler, python/numpy RNG states) to trainer.json. The data loader needs
no RNG state of its own: its order and augmentation are functions of (seed, epoch, index) (data.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..errors import BadValue, VitconvertError, param, unreadable_file
from ..folder import atomic_folder, check_file_readable
from ..recipes import stored_leaves
from .sums import TERMS

CHECKPOINT = "checkpoint-last"
FORMAT = 1
START_OVER = f"start over with {param('force', True)} without {param('resume')}"


@dataclass
class Position:
    """Where training stands: the epoch being trained, micro-batches of it consumed, optimizer updates done."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    best_top1: float = -1.0
    best_epoch: int = 0
    epoch_sums: list[float] = field(default_factory=list)  # running loss sums of the unfinished epoch
    window_sums: list[float] = field(default_factory=list)  # ... and since the last metrics.jsonl step record


# -- RNG states ------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """This process's python, numpy, torch (and CUDA) generator states."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {"python": [version, list(mt), gauss],
                             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back every generator a checkpoint saved (Python, NumPy, torch, CUDA): a resume then draws the same
    augmentations and dropout as the uninterrupted run."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch from the recipe's seed, so a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# -- optimizer state <-> safetensors + JSON ----------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def split_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An FQN-keyed optimizer state dict -> (tensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, dict[str, Any]] = {}
    for name, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                extra.setdefault(name, {})[key] = _jsonable(value)
    return tensors, {"param_groups": _jsonable(state["param_groups"]), "extra": extra}


def join_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state rebuilt from its flat safetensors form and trainer.json's non-tensor part."""
    state: dict[str, dict[str, Any]] = {}
    for flat, value in tensors.items():
        name, _, key = flat.rpartition("/")
        state.setdefault(name, {})[key] = value
    for name, values in meta.get("extra", {}).items():
        state.setdefault(name, {}).update(values)
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# -- write / read ----------------------------------------------------------------------------------------
def json_only(state: dict[str, Any]) -> dict[str, Any]:
    """Keep what JSON can hold exactly (timm schedulers recompute the rest from the step count)."""
    out = {}
    for key, value in state.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def write_checkpoint(run: Path, *, model: dict[str, torch.Tensor], optimizer: dict[str, Any],
                     ema: Optional[dict[str, torch.Tensor]], scheduler: dict[str, Any], scaler: dict[str, Any],
                     position: Position, recipe: dict[str, Any], rng: list[dict[str, Any]],
                     job: Optional[dict[str, Any]] = None) -> Path:
    """Write ``run/checkpoint-last`` atomically (a temporary sibling renamed over the old one). ``job`` names
    the teacher and the student's make (variant, layers, source): a resume checks it (``check_same_job``)."""
    from safetensors.torch import save_file

    rng_tensors: dict[str, torch.Tensor] = {}
    rng_json = []
    for rank, state in enumerate(rng):
        rng_tensors[f"rank{rank}.torch"] = state["torch"]
        for i, cuda in enumerate(state.get("cuda") or []):
            rng_tensors[f"rank{rank}.cuda{i}"] = cuda
        rng_json.append({"python": state["python"], "numpy": state["numpy"], "cuda": len(state.get("cuda") or [])})
    opt_tensors, opt_meta = split_optimizer(optimizer)
    with atomic_folder(run / CHECKPOINT, force=True) as tmp:
        save_file({k: v.contiguous() for k, v in model.items()}, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        if ema is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        meta = {"format": FORMAT, "position": asdict(position), "recipe": recipe, "world": len(rng),
                "optimizer": opt_meta, "scheduler": json_only(scheduler), "scaler": json_only(scaler),
                "rng": rng_json, **({"job": job} if job is not None else {})}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=1) + "\n")
    return run / CHECKPOINT


@dataclass
class Checkpoint:
    """A read checkpoint-last folder; tensors are loaded on demand."""

    folder: Path
    meta: dict[str, Any]

    @property
    def position(self) -> Position:
        """Where the run stopped: epoch, batch, step, the best top-1 and the running sums."""
        return Position(**self.meta["position"])

    @property
    def recipe(self) -> dict[str, Any]:
        """The recipe the run was trained with, as trainer.json recorded it."""
        return self.meta["recipe"]

    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.folder / name
        try:
            return load_file(str(path))
        except Exception as e:
            raise unreadable_file(path, e) from None

    def verify(self) -> None:
        """Read every field and file header the resume needs, so a damaged checkpoint is refused before the
        run folder is touched (a missing file, a truncated one, trainer.json without its fields)."""
        damaged = f"{self.folder}/trainer.json lacks or mangles %s: the checkpoint is damaged ({START_OVER})"
        meta = self.meta
        if not isinstance(meta, dict):
            raise VitconvertError(damaged % "everything")
        for key, kind in (("position", dict), ("recipe", dict), ("optimizer", dict), ("rng", list),
                          ("scheduler", dict)):
            if not isinstance(meta.get(key), kind):
                raise VitconvertError(damaged % f"'{key}'")
        try:
            position = Position(**meta["position"])
        except TypeError:
            raise VitconvertError(damaged % "'position'") from None
        counts = (position.epoch, position.batch, position.step, position.best_epoch)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise VitconvertError(damaged % "'position' (epoch, batch, step: counts, never negative)")
        for name in ("epoch_sums", "window_sums"):
            if not _sums_list(getattr(position, name)):
                raise VitconvertError(damaged % f"'position.{name}' ({len(TERMS) + 1} numbers: {', '.join(TERMS)} "
                                                 "and the image count)")
        if not isinstance(meta["optimizer"].get("param_groups"), list):
            raise VitconvertError(damaged % "'optimizer.param_groups'")
        names = ["model.safetensors", "optimizer.safetensors", "rng.safetensors"]
        names += ["ema.safetensors"] if stored_leaves(meta["recipe"]).get("optimization.ema") else []
        for name in names:
            path = self.folder / name
            if not path.is_file():
                raise VitconvertError(f"{path} is missing: the checkpoint is damaged ({START_OVER})")
            check_file_readable(path)

    def check_same_job(self, job: dict[str, Any], force: bool) -> None:
        """The resumed run's student must be made as the checkpoint's was (else its weights load into other
        layers), and its teacher the same unless ``force``. A checkpoint older than this record is trusted."""
        saved = self.meta.get("job")
        if not isinstance(saved, dict):
            return
        then, now = saved.get("student", {}), job.get("student", {})
        if then != now:
            changed = "; ".join(f"{k}: {then.get(k)} -> {now.get(k)}" for k in sorted({*then, *now})
                                if then.get(k) != now.get(k))
            raise BadValue("resume", f"this run's checkpoint is of another student ({changed}): its weights do not "
                                     f"fit this one; resume with the run's own student, or {START_OVER}")
        if saved.get("teacher") != job.get("teacher") and not force:
            raise BadValue("resume", f"this run was distilled from the teacher {saved.get('teacher')}, not "
                                     f"{job.get('teacher')}: resume with {param('teacher', saved.get('teacher'))} (or "
                                     f"add {param('force', True)} to continue under the new teacher)")

    def model(self) -> dict[str, torch.Tensor]:
        """The student's weights at the checkpoint."""
        return self._tensors("model.safetensors")

    def optimizer(self) -> dict[str, Any]:
        """The optimizer's state dict, rebuilt for ``load_state_dict``."""
        return join_optimizer(self._tensors("optimizer.safetensors"), self.meta["optimizer"])

    def ema(self) -> Optional[dict[str, torch.Tensor]]:
        """The EMA weights, when the run kept an EMA."""
        return self._tensors("ema.safetensors") if (self.folder / "ema.safetensors").is_file() else None

    def rng(self, rank: int) -> Optional[dict[str, Any]]:
        """This rank's RNG state, or None when the run was saved with fewer processes."""
        if rank >= len(self.meta["rng"]):
            return None
        tensors = self._tensors("rng.safetensors")
        saved = self.meta["rng"][rank]
        return {"python": saved["python"], "numpy": saved["numpy"], "torch": tensors[f"rank{rank}.torch"],
                "cuda": [tensors[f"rank{rank}.cuda{i}"] for i in range(saved.get("cuda", 0))]}


def _sums_list(value: Any) -> bool:
    """Running sums as a checkpoint stores them: none yet, or one number per term and the image count."""
    return isinstance(value, list) and len(value) in (0, len(TERMS) + 1) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def check_optimizer_fits(saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """The checkpoint's optimizer state is of this model's trainable parameters, group by group: state of another
    model (an optimizer.safetensors copied from another run) would load by name where names meet and leave the
    rest without state, silently."""
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [sorted(names.get(id(p), "?") for p in g["params"]) for g in optimizer.param_groups]
    theirs = [sorted(str(n) for n in g.get("params", [])) for g in saved["param_groups"]]
    if len(theirs) != len(ours):
        raise VitconvertError(f"the checkpoint's optimizer has {len(theirs)} parameter groups, this recipe makes "
                              f"{len(ours)}: new_params and layer_decay cannot change mid-run; {START_OVER}")
    foreign = sorted({*(n for g in theirs for n in g), *saved["state"]} - set(names.values()))
    missing = [n for g, h in zip(ours, theirs, strict=True) for n in g if n not in h]
    if foreign or missing:
        example = f"it has {foreign[0]!r}" if foreign else f"it lacks {missing[0]!r}"
        raise VitconvertError(f"the checkpoint's optimizer state is not of this student's parameters ({example}): "
                              f"optimizer.safetensors belongs to another model; {START_OVER}")


def read_checkpoint(run: Path) -> Checkpoint:
    """A run's checkpoint-last/, refused in one line when it is missing or damaged."""
    folder = run / CHECKPOINT
    meta_file = folder / "trainer.json"
    if folder.is_dir() and not meta_file.is_file():
        raise VitconvertError(f"{folder} has no trainer.json: the checkpoint is damaged ({START_OVER})")
    if not meta_file.is_file():
        raise BadValue("resume", f"{run} has no {CHECKPOINT}/ to resume from (start without {param('resume')})")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise VitconvertError(f"{meta_file} is not valid JSON: the checkpoint is damaged") from None
    if not isinstance(meta, dict):
        raise VitconvertError(f"{meta_file} is not a checkpoint description: the checkpoint is damaged")
    if not isinstance(meta.get("format", 0), int) or meta.get("format", 0) > FORMAT:
        raise VitconvertError(f"{folder} was written by a newer vitconvert (checkpoint format {meta['format']})")
    return Checkpoint(folder, meta)
