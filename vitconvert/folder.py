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
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

import timm
import torch
from torch import nn

from . import weights_file
from .attention import LinearAttention, variant_class
from .attention.options import read_options
from .card import render_card
from .errors import BadValue, VitconvertError, load_reason, param, unreadable_file
from .provenance import attach, report_of
from .state_file import load_state_file
from .surgery import linear_layer_indices, swap_attention
from .timm_registry import PREFIX, export_model_args, is_vitconvert_architecture, mark_as_linear, timm_config
from .version import __version__
from .writer import (  # noqa: F401  (the writer rule, re-exported)
    apply_umask,
    atomic_folder,
    check_output,
    output_lock,
    temporary_sibling,
    writable_error,
)

FORMAT_VERSION = 2  # 1: config.json named the softmax architecture (vitconvert 0.1)
WEIGHTS = "model.safetensors"
TIMM_PICKLE = "pytorch_model.bin"  # what timm's save_for_hf writes unless safe_serialization=True


class OldFolderWarning(UserWarning):
    """A folder in an older layout: vitconvert reads it, plain timm or transformers may not (``vitconvert upgrade``)."""


def versions() -> dict[str, str]:
    """The library versions that wrote a folder, recorded so a later load can say what changed."""
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


def write_model_files(model: nn.Module, folder: Path, meta: dict[str, Any],
                      card: Optional[str] = None) -> None:
    """Write config.json (+ "vitconvert" block), model.safetensors (aligned, marked, in one write) and README.md
    into an existing folder."""
    from timm.models._hub import save_config_for_hf  # save_for_hf's config half: the weights are ours to write

    variant, options = linear_attention_spec(model)
    linear, depth = linear_layer_indices(model)
    state_backup = model.training
    model.eval()
    try:
        save_config_for_hf(model, str(folder / "config.json"), model_args=export_model_args(model))
        weights_file.write_weights(folder / WEIGHTS, model.state_dict(), mark_metadata(variant, linear))
    finally:
        model.train(state_backup)
    pinned = next(m for m in model.modules() if isinstance(m, LinearAttention)).pinned_options()
    hybrid = linear if len(linear) != depth else None
    config = timm_config(json.loads((folder / "config.json").read_text()), variant, pinned, hybrid)
    config["vitconvert"] = {"format_version": FORMAT_VERSION, **meta, "variant": variant, "options": options,
                            "depth": depth, "layers": linear, "versions": versions()}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if card is None:
        card = render_card(config)
    (folder / "README.md").write_text(card)


def save(model: nn.Module, folder: Union[str, Path], force: bool = False, inputs: Iterable[Union[str, Path]] = (),
         **meta: Any) -> Path:
    """Save a converted model as a folder, atomically; never overwrites without ``force``, and never a folder
    vitconvert did not write or one of ``inputs`` (writer.check_output)."""
    folder = Path(folder)
    info = {**report_of(model), **meta}
    with atomic_folder(folder, force=force, inputs=inputs) as tmp:
        write_model_files(model, tmp, info)
    return folder


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder, with clear errors for a missing or broken one."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file() and (folder / "checkpoint-last" / "trainer.json").is_file():
        raise VitconvertError(f"{folder} is a distill run that has not finished (stopped or still running): its "
                              "model is written when it ends, only checkpoint-last/ is there; finish it by resuming "
                              f"distill with {param('resume', True)} and {param('out', folder)}")
    if not cfg_file.is_file():
        raise VitconvertError(f"{folder} has no config.json: not a timm or vitconvert model folder")
    try:
        return json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VitconvertError(f"{cfg_file} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None


def check_file_readable(path: Path) -> None:
    """Fail with one line on a corrupt/truncated safetensors file (every tensor's header and slice read) before
    timm or a resume does with a traceback."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key)
    except Exception as e:
        raise unreadable_file(path, e) from None


def check_weights_readable(folder: Path) -> None:
    """:func:`check_file_readable` on each safetensors file of a model folder."""
    for path in folder.glob("*.safetensors"):
        check_file_readable(path)


def weights_in(folder: Path) -> Path:
    """model.safetensors; in a folder that holds only timm's pickle (save_for_hf, safe_serialization=False), that
    pickle, read weights_only, its config.json's block saying what it holds (``weights_file.check_weights``)."""
    pickle = folder / TIMM_PICKLE
    return pickle if not (folder / WEIGHTS).is_file() and pickle.is_file() else folder / WEIGHTS


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise VitconvertError(f"{path.parent} has no {path.name}")
    if path.suffix != ".safetensors":
        return load_state_file(path)
    try:
        return load_file(str(path))
    except Exception as e:
        raise unreadable_file(path, e) from None


def check_options(variant: str, options: Any, param: str = "option") -> dict[str, Any]:
    """Every option of ``variant``, ``options``' values read and checked by the variant's declaration (the rest
    their defaults): a bad value is refused where it is given (``BadValue(param, ...)``), not as a TypeError when
    the model first runs."""
    cls = variant_class(variant)
    return read_options(cls.declared_options, options, variant, param)


def folder_block(config: dict[str, Any]) -> Optional[dict[str, Any]]:
    """config.json's "vitconvert" block; for a folder that timm's own savers wrote from a vitconvert model
    (``save_for_hf``, ``push_to_hf_hub``: no block, architecture ``vitconvert_<variant>``), the block its
    model_args imply; None for anything else (a softmax timm folder)."""
    block = config.get("vitconvert")
    if block is not None or not is_vitconvert_architecture(config.get("architecture")):
        return block
    args = config.get("model_args") or {}
    layers = {"layers": args["layers"]} if isinstance(args.get("layers"), list) else {}
    return {"format_version": FORMAT_VERSION, "variant": config["architecture"].removeprefix(PREFIX),
            "options": args.get("options") or {}, **layers, "saved_by": "timm"}


def upgrade_reasons(config: dict[str, Any]) -> list[str]:
    """What an older layout of config.json (or one timm's own savers wrote from a vitconvert model) keeps other
    readers from doing; empty for today's layout and for anything that is not a vitconvert model."""
    block = folder_block(config)
    if block is None:
        return []
    reasons = []
    if "vitconvert" not in config:
        reasons.append("timm's own saver wrote it without vitconvert's block, which push, info and the card read")
    elif block.get("format_version", 1) < FORMAT_VERSION:
        reasons.append("timm and transformers read its format-1 config.json as a softmax model")
    if is_vitconvert_architecture(config.get("architecture")) and "num_classes" in (config.get("model_args") or {}):
        reasons.append("transformers cannot load it (num_classes in model_args)")
    return reasons


def upgrade_notice(folder: Path, config: dict[str, Any]) -> Optional[str]:
    """One line naming ``vitconvert upgrade`` for a folder in an older layout, else None."""
    reasons = upgrade_reasons(config)
    if not reasons:
        return None
    fix = ("`vitconvert upgrade DIR` on a downloaded copy rewrites it (then push that)" if in_hub_cache(folder)
           else f"`vitconvert upgrade {folder}` rewrites it in place")
    layout = "an older vitconvert folder layout" if "vitconvert" in config else "timm's layout"
    return f"{folder} is in {layout} ({'; '.join(reasons)}): {fix}"


def in_hub_cache(folder: Path) -> bool:
    """A snapshot in huggingface_hub's cache (models--org--name/snapshots/REV), which is never rewritten."""
    return folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--")


def mark_metadata(variant: str, linear: list[int]) -> dict[str, str]:
    """What model.safetensors records of itself: the variant and which layers hold linear attention, so a config.json
    edited afterwards cannot load the weights into other attention (ELU, ReLU and softmax weights fit each other)."""
    return {weights_file.VARIANT_KEY: variant, weights_file.LAYERS_KEY: json.dumps(linear)}


def marked_layers(path: Path) -> Optional[list[int]]:
    """The linear layers model.safetensors records (None for files written before the mark, and for a pickle)."""
    mark = weights_file.read_mark(path) if path.suffix == ".safetensors" else None
    return mark.layers if mark is not None else None


def check_layers(folder: Path, block: dict[str, Any]) -> None:
    """The vitconvert block's layer list: layer indices below its depth, at least one, and the ones the weights
    file was written with."""
    layers, depth = block.get("layers"), block.get("depth")
    if layers is None:
        return
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers) or (
            isinstance(depth, int) and not all(0 <= i < depth for i in layers)):
        raise VitconvertError(f"{folder}/config.json: its vitconvert 'layers' must list layer indices from 0 to "
                              f"{depth - 1 if isinstance(depth, int) else 'depth - 1'} (got {layers!r})")
    if not layers:
        raise VitconvertError(f"{folder}/config.json makes no layer linear: that is the softmax model, not a "
                              "vitconvert one; use its source, or restore the layer list")
    saved = marked_layers(weights_in(folder))
    if saved is not None and saved != layers:
        raise VitconvertError(f"{folder}/config.json makes layers {layers} linear but {WEIGHTS} holds linear "
                              f"attention in layers {saved}: the weights would load into the wrong attention; "
                              "restore config.json's layer list")


def check_folder(folder: Path, config: dict[str, Any]) -> None:
    """What ``load`` checks before it builds anything: format, architecture, variant, options, readable weights
    (``info`` runs it, so a folder that cannot load never reports as fine)."""
    block = folder_block(config)
    if not isinstance(block, dict):
        raise VitconvertError(f"{folder} is not a vitconvert folder (its config.json has no 'vitconvert' block)")
    if not isinstance(block.get("format_version", 0), int) or block.get("format_version", 0) > FORMAT_VERSION:
        raise VitconvertError(f"{folder} was written by a newer vitconvert (format {block.get('format_version')})")
    arch = config.get("architecture")
    if not isinstance(arch, str) or not timm.is_model(arch):
        raise VitconvertError(f"{folder}/config.json names no architecture timm knows (architecture: {arch!r})")
    try:
        variant = variant_class(block.get("variant"), param="variant").variant
    except BadValue as e:
        raise VitconvertError(f"{folder}/config.json: {e}") from None
    try:
        check_options(variant, block.get("options") or {})
    except BadValue as e:
        raise VitconvertError(f"{folder}/config.json options: {e}") from None
    weights = weights_in(folder)
    if not weights.is_file() or pickled_by_timm(folder, config):
        fix = (f" (timm's save_for_hf wrote {TIMM_PICKLE}): `vitconvert upgrade {folder}` writes it"
               if pickled_by_timm(folder, config) else "")
        raise VitconvertError(f"{folder} has no {WEIGHTS}{fix}")
    check_weights_readable(folder)
    check_layers(folder, block)
    mark = weights_file.read_mark(weights) if weights.suffix == ".safetensors" else None
    if mark is not None and mark.variant is not None and mark.variant != variant:
        raise VitconvertError(f"{folder}/config.json names {variant} attention but {WEIGHTS} holds {mark.variant} "
                              f"attention weights: they would load into the wrong attention; restore config.json's "
                              f"variant ({mark.variant})")


def load_folder_model(folder: Path, config: dict[str, Any]) -> nn.Module:
    """Rebuild architecture from config.json, swap attention as recorded, load strictly."""
    check_folder(folder, config)  # the same checks `info` makes, each one line
    block = folder_block(config)
    assert block is not None  # check_folder refused anything else
    if notice := upgrade_notice(folder, config):
        warnings.warn(notice, OldFolderWarning, stacklevel=3)
    weights = weights_in(folder)
    state = _read_weights(weights)
    with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG (bitwise resume)
        model = _build(folder)
        if not any(isinstance(m, LinearAttention) for m in model.modules()):  # format 1: timm built softmax
            model, swapped = swap_attention(model, block["variant"], block.get("options", {}), inplace=True,
                                            layers=block.get("layers"))
            mark_as_linear(model, block["variant"], swapped.layers if swapped.hybrid else None)
    recorded, built = block.get("layers"), linear_layer_indices(model)[0]
    if isinstance(recorded, list) and built != recorded:  # ELU and softmax weights fit either way: never load it
        raise VitconvertError(f"{folder}/config.json disagrees with itself: its vitconvert block makes layers "
                              f"{recorded} linear, its model_args {built}")
    variant = linear_attention_spec(model)[0]
    if variant != variant_class(block["variant"]).variant:
        raise VitconvertError(f"{folder}/config.json disagrees with itself: its vitconvert block names "
                              f"{block['variant']} attention, its architecture builds {variant}")
    # the layer list removed from both: the weights still know
    weights_file.check_weights(weights, variant, built, f"{folder}/config.json")
    return _load_into(model, state, folder, weights.name, block)


def _build(folder: Path) -> nn.Module:
    """The architecture the folder's config.json names, built by timm (``local-dir:``), its weights not loaded."""
    try:
        return timm.create_model(f"local-dir:{folder}", pretrained=False)
    except Exception as e:
        raise VitconvertError(f"cannot rebuild the architecture in {folder}/config.json: {e}") from None


def _load_into(model: nn.Module, state: dict[str, torch.Tensor], folder: Path, name: str,
               block: dict[str, Any]) -> nn.Module:
    """``state`` (of the folder's file ``name``) loaded strictly into ``model``, the folder's record attached."""
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise VitconvertError(f"{folder}/{name} does not fit its config.json: {load_reason(e)}") from None
    attach(model, {k: v for k, v in block.items() if k not in ("format_version", "versions")})
    return model.eval()


def pickled_by_timm(folder: Path, config: dict[str, Any]) -> bool:
    """A folder timm's save_for_hf wrote from a vitconvert model with its default format, torch's pickle."""
    return ("vitconvert" not in config and folder_block(config) is not None and not (folder / WEIGHTS).is_file()
            and (folder / TIMM_PICKLE).is_file())


def load_timm_pickle(folder: Path, config: dict[str, Any]) -> nn.Module:
    """The model of such a folder, its tensors read with weights_only (never unpickled) and loaded strictly."""
    state = load_state_file(folder / TIMM_PICKLE)
    with torch.random.fork_rng(devices=[]):
        model = _build(folder)
    return _load_into(model, state, folder, TIMM_PICKLE, folder_block(config) or {})
