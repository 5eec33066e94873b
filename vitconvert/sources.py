"""SOURCE string -> a timm softmax ViT, through timm's own loading.

A source is a timm name, a short alias, ``digits`` (the bundled teacher), ``hf-hub:org/name[@revision]``,
``local-dir:PATH`` or a plain folder path (timm ``save_for_hf`` layout or a vitconvert folder), or a weights
file used with ``arch``.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import timm
import torch
from torch import nn

from .errors import VitconvertError, first_line

ALIASES: dict[str, str] = {
    "deit_tiny": "deit_tiny_patch16_224",
    "deit_small": "deit_small_patch16_224",
    "deit_base": "deit_base_patch16_224",
    "deit_tiny_distilled": "deit_tiny_distilled_patch16_224",
    "deit_small_distilled": "deit_small_distilled_patch16_224",
    "deit_base_distilled": "deit_base_distilled_patch16_224",
    "deit3_small": "deit3_small_patch16_224",
    "deit3_base": "deit3_base_patch16_224",
    "vit_tiny": "vit_tiny_patch16_224",
    "vit_small": "vit_small_patch16_224",
    "vit_base": "vit_base_patch16_224",
    "vit_large": "vit_large_patch16_224",
    "dinov2_small": "vit_small_patch14_dinov2",
    "dinov2_base": "vit_base_patch14_dinov2",
    "eva02_tiny": "eva02_tiny_patch14_224",
    "eva02_small": "eva02_small_patch14_224",
    "beit_base": "beit_base_patch16_224",
    "clip_base": "vit_base_patch16_clip_224",
    "siglip_base": "vit_base_patch16_siglip_224",
}

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def bundled_folder(name: str) -> Optional[Path]:
    """Model folders shipped in the package (offline): ``digits`` is the quickstart's softmax teacher."""
    if name == "digits":
        from .assets import teacher_folder

        return teacher_folder()
    return None


@dataclass
class Source:
    """A loaded softmax model and where it came from (recorded in the converted folder)."""

    model: nn.Module
    arch: str
    spec: str  # the SOURCE string as the user gave it
    pretrained: bool
    vitconvert: Optional[dict[str, Any]] = None  # the "vitconvert" block when the source is a vitconvert folder
    extra: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=1)
def _known_names() -> tuple[str, ...]:
    return tuple(timm.list_models()) + tuple(ALIASES) + ("digits",)


def resolve_alias(name: str) -> str:
    return ALIASES.get(name, name)


def suggest(name: str) -> str:
    close = difflib.get_close_matches(name, _known_names(), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else "; see `vitconvert list` for aliases"


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder, with clear errors for a missing or broken one."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise VitconvertError(f"{folder} has no config.json: not a timm or vitconvert model folder")
    try:
        return json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VitconvertError(f"{cfg_file} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None


def load_state_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a weights file: safetensors, or a torch file read with weights_only=True (never unpickled)."""
    if not path.is_file():
        raise VitconvertError(f"weights file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch raise many types for truncated/corrupt files
        reason = first_line(e)
        raise VitconvertError(f"cannot read {path}: corrupt, truncated or not a weights file ({reason})") from None
    for key in ("state_dict", "model", "model_ema", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VitconvertError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _create(name: str, pretrained: bool, spec: str, **kwargs: Any) -> nn.Module:
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except RuntimeError as e:
        msg = first_line(e)
        if "size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e):
            raise VitconvertError(f"the weights of {spec} do not fit architecture {name}: {msg}") from None
        raise VitconvertError(f"cannot build {spec}: {msg}") from None
    except (OSError, ValueError) as e:
        msg = first_line(e)
        if pretrained and ("offline" in msg.lower() or "connect" in msg.lower() or "resolve" in msg.lower()
                           or "cache" in msg.lower() or "not found" in msg.lower() or "404" in msg):
            raise VitconvertError(
                f"cannot get pretrained weights for {spec} (no network and not in the Hub cache?): {msg}; "
                "use --no-pretrained for a randomly initialised model") from None
        raise VitconvertError(f"cannot load {spec}: {msg}") from None


def parse_hub_id(spec: str) -> tuple[str, Optional[str]]:
    """'hf-hub:org/name@rev' -> ('org/name', 'rev'), refusing ids the Hub would refuse."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo = spec.split(":", 1)[1]
    repo, _, revision = repo.partition("@")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise VitconvertError(f"invalid Hub id {repo!r}: expected hf-hub:org/name[@revision]") from None
    return repo, revision or None


def hub_folder(spec: str) -> Path:
    """Download (or find in the cache, offline) a Hub repo's config + weights; returns the snapshot folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, revision = parse_hub_id(spec)
    try:
        return Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=["config.json", "*.safetensors", "README.md", "*.yaml"]))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        where = f"{repo}@{revision}" if revision else repo
        from .hub import hub_offline

        offline = hub_offline()
        if offline and isinstance(e, LocalEntryNotFoundError):
            from .hub import cached_revisions

            cached = cached_revisions(repo)
            have = f"cached revisions: {', '.join(cached)}" if cached else "nothing of this repo is cached"
            raise VitconvertError(f"{where} is not in the Hub cache and HF_HUB_OFFLINE is set ({have}); "
                                  "unset HF_HUB_OFFLINE to download it") from None
        hint = " (HF_HUB_OFFLINE is set and it is not in the Hub cache)" if offline else ""
        raise VitconvertError(f"cannot get {where} from the Hugging Face Hub{hint}: {first_line(e)}") from None


def shadowed_name(spec: str, path: Path) -> bool:
    """A bare name (``digits``, ``deit_small``) that a local non-model folder of the same name would hide:
    the name wins; ``./digits`` still means the folder."""
    bare = os.sep not in spec and not spec.startswith(".") and not spec.endswith(WEIGHT_SUFFIXES)
    if not bare or (path / "config.json").is_file() or path.is_file():
        return False
    return bundled_folder(spec) is not None or spec in ALIASES or timm.is_model(spec)


def load_source(spec: str, pretrained: bool = True, arch: Optional[str] = None, **model_kwargs: Any) -> Source:
    """Resolve any SOURCE string to a loaded timm model."""
    if not spec or not spec.strip():
        raise VitconvertError("empty model source")
    if spec.startswith("hf-hub:"):
        return load_folder(hub_folder(spec), spec, **model_kwargs)
    if spec.startswith("local-dir:"):
        return load_folder(Path(spec.split(":", 1)[1]), spec, **model_kwargs)
    path = Path(spec).expanduser()
    looks_like_path = path.exists() or os.sep in spec or spec.endswith(WEIGHT_SUFFIXES) or spec.startswith(".")
    if looks_like_path and shadowed_name(spec, path):
        looks_like_path = False  # `digits` is the bundled teacher even beside a ./digits image folder (as --data)
    if looks_like_path:
        if not path.exists():
            raise VitconvertError(f"path not found: {spec}")
        if path.is_dir():
            return load_folder(path, spec, **model_kwargs)
        return load_weights_file(path, spec, arch, **model_kwargs)
    bundled = bundled_folder(spec)
    if bundled is not None:
        return load_folder(bundled, spec, **model_kwargs)
    name = resolve_alias(spec)
    if not timm.is_model(name):
        raise VitconvertError(f"unknown model {spec!r}{suggest(spec)}")
    model = _create(name, pretrained, spec, **model_kwargs)
    return Source(model, name, spec, pretrained)


def load_folder(folder: Path, spec: str, **model_kwargs: Any) -> Source:
    """A timm ``save_for_hf`` folder or a vitconvert folder (the latter keeps its linear attention)."""
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    cfg = read_config(folder)
    if "vitconvert" in cfg:
        from .folder import load_folder_model

        model = load_folder_model(folder, cfg)
        from .timm_registry import source_architecture

        return Source(model, source_architecture(cfg)[0], spec, True, vitconvert=cfg["vitconvert"])
    if "architecture" not in cfg:
        raise VitconvertError(f"{folder}/config.json has no 'architecture': not a timm model folder")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise VitconvertError(f"{folder} has config.json but no weights (model.safetensors)")
    _check_weights_readable(folder)
    model = _create(f"local-dir:{folder}", True, spec, **model_kwargs)
    return Source(model, cfg["architecture"], spec, True)


def _check_weights_readable(folder: Path) -> None:
    """Fail with one line on a corrupt/truncated safetensors before timm does with a traceback."""
    from safetensors import safe_open

    for f in folder.glob("*.safetensors"):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    fh.get_slice(key)
        except Exception as e:
            raise VitconvertError(f"cannot read {f}: corrupt or truncated safetensors ({first_line(e)})") from None


def load_weights_file(path: Path, spec: str, arch: Optional[str], **model_kwargs: Any) -> Source:
    """A bare weights file needs ``--arch``; timm builds the model and its filter adapts the keys."""
    if path.suffix not in WEIGHT_SUFFIXES:
        raise VitconvertError(f"{path.name} is a file, not a model: give a model folder, a timm name, or a weights "
                              f"file ({', '.join(WEIGHT_SUFFIXES)})")
    if arch is None:
        raise VitconvertError(f"{path.name} is a bare weights file with no architecture: `vitconvert convert "
                              f"{path} --arch NAME` reads it; other commands take a model folder")
    name = resolve_alias(arch)
    if not timm.is_model(name):
        raise VitconvertError(f"unknown architecture {arch!r}{suggest(arch)}")
    state = load_state_file(path)  # validates the file in one line before timm reads it
    overlay: dict[str, Any] = {"file": str(path)}
    head = state.get("head.weight")
    if head is not None and head.dim() == 2:
        overlay["num_classes"] = head.shape[0]
        model_kwargs.setdefault("num_classes", head.shape[0])
    model = _create(name, True, spec, pretrained_cfg_overlay=overlay, **model_kwargs)
    return Source(model, name, spec, True)
