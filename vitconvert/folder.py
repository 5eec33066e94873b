"""The model folder, vitconvert's unit of exchange: config.json + model.safetensors + README.md.

config.json is timm's own (``save_for_hf``: architecture, model_args, pretrained_cfg) plus a "vitconvert"
block, so the folder is also a valid Hub repo. Its ``architecture`` is ``vitconvert_<variant>`` (format 2), a
timm model that ``import vitconvert`` registers (timm_registry.py): timm builds the linear model from the folder,
and plain timm refuses instead of building softmax attention. Writes are atomic (temporary sibling, then
rename); reads rebuild the architecture (format 1 folders: the softmax one, then swap attention as recorded)
and load strictly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import timm
import torch
from torch import nn

from . import __version__
from .attention import LinearAttention
from .errors import VitconvertError, first_line
from .timm_registry import export_model_args, timm_config

FORMAT_VERSION = 2  # 1: config.json named the softmax architecture (vitconvert 0.1)
WEIGHTS = "model.safetensors"


def versions() -> dict[str, str]:
    import safetensors

    return {"vitconvert": __version__, "timm": timm.__version__, "torch": torch.__version__.split("+")[0],
            "safetensors": safetensors.__version__}


def linear_attention_spec(model: nn.Module) -> tuple[str, dict[str, Any]]:
    """(variant, options) of the model's linear attention; one variant per model."""
    found = {(m.variant, json.dumps(m.options, sort_keys=True)) for m in model.modules()
             if isinstance(m, LinearAttention)}
    if not found:
        raise VitconvertError("this model has no linear attention: convert it first (vitconvert.convert)")
    if len(found) > 1:
        raise VitconvertError("mixed attention variants in one model are not supported by the folder format")
    variant, options = found.pop()
    return variant, json.loads(options)


@contextmanager
def atomic_folder(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out``, on failure it vanishes."""
    out = Path(out)
    if out.exists() and not force:
        raise VitconvertError(f"{out} already exists; use --force to overwrite it")
    if out.exists() and not out.is_dir():
        raise VitconvertError(f"{out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_model_files(model: nn.Module, folder: Path, meta: dict[str, Any],
                      card: Optional[str] = None) -> None:
    """Write config.json (+ "vitconvert" block), model.safetensors and README.md into an existing folder."""
    from timm.models import save_for_hf

    variant, options = linear_attention_spec(model)
    state_backup = model.training
    save_for_hf(model.eval(), str(folder), model_args=export_model_args(model), safe_serialization=True)
    model.train(state_backup)
    pinned = next(m for m in model.modules() if isinstance(m, LinearAttention)).pinned_options()
    config = timm_config(json.loads((folder / "config.json").read_text()), variant, pinned)
    config["vitconvert"] = {"format_version": FORMAT_VERSION, **meta, "variant": variant, "options": options,
                            "versions": versions()}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if card is None:
        from .card import render_card

        card = render_card(config)
    (folder / "README.md").write_text(card)


def save(model: nn.Module, folder: Union[str, Path], force: bool = False, **meta: Any) -> Path:
    """Save a converted model as a folder, atomically; never overwrites without ``force``."""
    folder = Path(folder)
    info = {**getattr(model, "vitconvert_report", {}), **meta}
    with atomic_folder(folder, force=force) as tmp:
        write_model_files(model, tmp, info)
    return folder


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise VitconvertError(f"{path.parent} has no {path.name}")
    try:
        return load_file(str(path))
    except Exception as e:
        reason = first_line(e, limit=160)
        raise VitconvertError(f"cannot read {path}: corrupt or truncated safetensors ({reason})") from None


def load_folder_model(folder: Path, config: dict[str, Any]) -> nn.Module:
    """Rebuild architecture from config.json, swap attention as recorded, load strictly."""
    from .surgery import swap_attention

    block = config["vitconvert"]
    if block.get("format_version", 0) > FORMAT_VERSION:
        raise VitconvertError(f"{folder} was written by a newer vitconvert (format {block['format_version']})")
    state = _read_weights(folder / WEIGHTS)
    with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG (bitwise resume)
        try:
            model = timm.create_model(f"local-dir:{folder}", pretrained=False)
        except Exception as e:
            raise VitconvertError(f"cannot rebuild the architecture in {folder}/config.json: {e}") from None
        if not any(isinstance(m, LinearAttention) for m in model.modules()):  # format 1: timm built softmax
            model, _ = swap_attention(model, block["variant"], block.get("options", {}), inplace=True)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise VitconvertError(f"{folder}/{WEIGHTS} does not fit its config.json: {first_line(e)}") from None
    model.vitconvert_report = {k: v for k, v in block.items() if k not in ("format_version", "versions")}
    return model.eval()


def load(spec: Union[str, Path]) -> nn.Module:
    """A model from a vitconvert folder, a run folder or ``hf-hub:org/name[@rev]`` (or any timm source)."""
    from .sources import hub_folder, load_source, read_config

    spec = str(spec)
    if spec.startswith("hf-hub:"):
        folder = hub_folder(spec)
    else:
        folder = Path(spec.removeprefix("local-dir:")).expanduser()
        if not folder.exists():
            raise VitconvertError(f"path not found: {spec}")
    if folder.is_dir() and "vitconvert" in read_config(folder):
        return load_folder_model(folder, read_config(folder))
    return load_source(spec).model
