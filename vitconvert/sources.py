"""SOURCE strings: what one names (``resolve``, the one parser of them all) and softmax models through timm.

A SOURCE is a timm name, a short alias, ``digits`` (the bundled teacher), ``hf-hub:org/name[@revision]``,
``local-dir:PATH`` or a plain path (``~`` expanded) to a model folder, or a weights file (read with ``arch``).
``resolve`` says which, reading only the string and the file system (and the Hub for ``hf-hub:``, whose folder
it fetches); every command and ``vitconvert.load`` start from it. ``load_source`` loads softmax models only: a
vitconvert (linear) folder is refused from its config.json, before any weights are read — ``vitconvert.load``
(loading.py) is the one entry that takes either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import timm
from torch import nn

from .aliases import ALIASES, resolve_alias, suggest
from .assets import teacher_folder
from .errors import BadValue, VitconvertError, first_line, load_reason, param
from .folder import check_weights_readable, folder_block, read_config
from .hub_io import cached_weights, check_endpoint, hub_offline, hub_reachable, hub_snapshot, parse_repo_id
from .state_file import load_state_file
from .timm_registry import source_architecture
from .weights_file import check_softmax_weights

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
SOFTMAX_FORMS = "a timm name or alias, digits, hf-hub:org/name[@revision], or a model folder (PATH or local-dir:PATH)"


def bundled_folder(name: str) -> Optional[Path]:
    """Model folders shipped in the package (offline): ``digits`` is the quickstart's softmax teacher."""
    if name == "digits":
        return teacher_folder()
    return None


class LinearSourceError(VitconvertError):
    """A vitconvert folder where a softmax source was expected."""


class SourceNotFound(VitconvertError):
    """A SOURCE string that names nothing: a path that does not exist, a name neither timm nor we know."""


@dataclass(frozen=True)
class Resolved:
    """What a SOURCE string names, nothing loaded yet.

    ``kind`` is "folder" (a local folder, a run folder, a Hub snapshot or the bundled model: ``path``), "file"
    (a weights file or any other file: ``path``) or "timm" (a timm name, ``name`` with an alias resolved);
    ``repo_id``/``revision`` say a folder came from the Hub, ``bundled`` that it ships in the package."""

    spec: str  # as the user gave it: what messages and config.json's "source" show
    kind: Literal["folder", "file", "timm"]
    path: Optional[Path] = None
    name: Optional[str] = None
    repo_id: Optional[str] = None
    revision: Optional[str] = None
    bundled: bool = False

    def config(self) -> dict[str, Any]:
        """The folder's config.json (one line when there is none: not a model folder)."""
        assert self.path is not None and self.kind == "folder"
        return read_config(self.path)

    @property
    def linear(self) -> bool:
        """A vitconvert folder (ours, or one timm's savers wrote from ours), rather than a softmax model."""
        return self.kind == "folder" and folder_block(self.config()) is not None


def looks_like_path(spec: str, path: Path) -> bool:
    """A string meant as a path: it exists, has a separator, starts with ``.`` or ``~``, or ends like weights."""
    return path.exists() or os.sep in spec or spec.startswith((".", "~")) or spec.endswith(WEIGHT_SUFFIXES)


def resolve(spec: Union[str, Path]) -> Resolved:
    """What ``spec`` names: ``hf-hub:`` (fetched, or found in the Hub cache offline), ``local-dir:``, a path, the
    bundled ``digits``, an alias or a timm name, in that order; a bare name beats a same-named folder that holds
    no model (``shadowed_name``). A string that names nothing is one line (``SourceNotFound``)."""
    spec = str(spec)
    if not spec.strip():
        raise SourceNotFound("empty model source")
    if spec.startswith("hf-hub:"):
        repo_id, revision = parse_repo_id(spec)
        return Resolved(spec, "folder", hub_snapshot(repo_id, revision), repo_id=repo_id, revision=revision)
    if spec.startswith("local-dir:"):
        path = Path(spec.removeprefix("local-dir:")).expanduser()
        if not path.is_dir():
            raise SourceNotFound(f"folder not found: {path}" if not path.exists() else
                                 f"{spec}: local-dir: names a folder, and {path} is a file")
        return Resolved(spec, "folder", path)
    path = Path(spec).expanduser()
    if looks_like_path(spec, path) and not shadowed_name(spec, path):
        if not path.exists():
            raise SourceNotFound(f"path not found: {spec}")
        return Resolved(spec, "folder" if path.is_dir() else "file", path)
    bundled = bundled_folder(spec)
    if bundled is not None:
        return Resolved(spec, "folder", bundled, bundled=True)
    name = resolve_alias(spec)
    if not timm.is_model(name):
        raise SourceNotFound(f"unknown model {spec!r}{suggest(spec)}")
    return Resolved(spec, "timm", name=name)


def lasting_spec(spec: str) -> str:
    """``spec`` as a converted folder records its source (config.json's "source": distill's and compare's teacher):
    a local path made absolute, since a relative one names another folder, or a timm model of the same name, or
    nothing, from another directory; every other form (hf-hub:, a timm name or alias, digits) as given."""
    if spec.startswith("hf-hub:"):
        return spec
    resolved = resolve(spec)
    if resolved.kind == "timm" or resolved.bundled or resolved.path is None:
        return spec
    return os.path.abspath(resolved.path)  # not resolve(): a link the user gave stays the name recorded


def shadowed_name(spec: str, path: Path) -> bool:
    """A bare name (``digits``, ``deit_small``) that a local non-model folder of the same name would hide:
    the name wins; ``./digits`` still means the folder."""
    bare = os.sep not in spec and not spec.startswith((".", "~")) and not spec.endswith(WEIGHT_SUFFIXES)
    if not bare or (path / "config.json").is_file() or path.is_file():
        return False
    return bundled_folder(spec) is not None or spec in ALIASES or timm.is_model(spec)


@dataclass
class Source:
    """A loaded softmax model and where it came from (recorded in the converted folder)."""

    model: nn.Module
    arch: str
    spec: str  # the SOURCE string as the user gave it
    pretrained: bool


def below_a_patch(error: Exception) -> bool:
    """torch's words (its pooling, resampling the position embeddings) for an image smaller than one patch."""
    return "sizes should be greater than 0" in first_line(error)


def smaller_than_a_patch(img_size: int, spec: Any) -> BadValue:
    """The one line for an image size below one patch of ``spec`` (convert's source, export's model)."""
    return BadValue("img_size", f"{img_size} px is smaller than one patch of {spec}: the image would have no patch "
                                "grid; give a size of at least one patch")


def _create(name: str, pretrained: bool, spec: str, **kwargs: Any) -> nn.Module:
    if pretrained and needs_hub(name, kwargs):
        check_weights_reachable(name, spec)
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except RuntimeError as e:
        msg = first_line(e)
        if "size mismatch" in str(e) or "Missing key" in str(e) or "Unexpected key" in str(e):
            raise VitconvertError(f"the weights of {spec} do not fit architecture {name}: {load_reason(e)}") from None
        if kwargs.get("img_size") and below_a_patch(e):
            raise smaller_than_a_patch(kwargs["img_size"], spec) from None
        if pretrained and "No pretrained weights exist" in msg:  # timm's words, which name its Python argument
            raise VitconvertError(f"timm has no pretrained weights for {spec}: use {param('pretrained', False)} "
                                  "for a randomly initialised model") from None
        raise VitconvertError(f"cannot build {spec}: {msg}") from None
    except (OSError, ValueError) as e:
        msg = first_line(e)
        if pretrained and ("offline" in msg.lower() or "connect" in msg.lower() or "resolve" in msg.lower()
                           or "cache" in msg.lower() or "not found" in msg.lower() or "404" in msg):
            raise VitconvertError(
                f"cannot get pretrained weights for {spec} (no network and not in the Hub cache?): {msg}; "
                f"use {param('pretrained', False)} for a randomly initialised model") from None
        raise VitconvertError(f"cannot load {spec}: {msg}") from None


def needs_hub(name: str, kwargs: dict[str, Any]) -> bool:
    """Pretrained weights come from the Hub unless they are a local folder's or a weights file's (timm's overlay)."""
    return not name.startswith("local-dir:") and not (kwargs.get("pretrained_cfg_overlay") or {}).get("file")


def check_weights_reachable(name: str, spec: str) -> None:
    """Weights on the Hub that are not in its cache need the Hub: one quick request says whether it answers,
    instead of a minute of huggingface_hub's retry warnings before the same error."""
    try:
        repo_id = timm.models.get_pretrained_cfg(name).hf_hub_id
    except Exception:  # no pretrained config (weights by URL, a custom name): timm says what it can
        return
    if not repo_id or cached_weights(repo_id):
        return
    if hub_offline():  # said in our words: huggingface_hub's own sentence is broken and does not name the switch
        raise VitconvertError(f"cannot get pretrained weights for {spec}: HF_HUB_OFFLINE is set and {repo_id} is not "
                              f"in the Hub cache; unset HF_HUB_OFFLINE to download them, or use "
                              f"{param('pretrained', False)} for a randomly initialised model")
    check_endpoint()
    if hub_reachable():
        return
    raise VitconvertError(f"cannot get pretrained weights for {spec}: the Hub (huggingface.co) does not answer and "
                          f"{repo_id} is not in the Hub cache; use {param('pretrained', False)} for a randomly "
                          "initialised model, or fill the cache on a machine with a network")


def load_source(source: Union[str, Path, Resolved], pretrained: bool = True, arch: Optional[str] = None,
                **model_kwargs: Any) -> Source:
    """The softmax model a SOURCE names (``arch``: the timm architecture of a bare weights file)."""
    resolved = source if isinstance(source, Resolved) else resolve(source)
    if arch is not None and resolved.kind != "file":  # it was dropped without a word: the model was another one
        what = ("a model folder: its config.json names the architecture" if resolved.kind == "folder"
                else "a timm model name: it is the architecture")
        raise BadValue("arch", f"names the timm architecture of a bare weights file only; {resolved.spec} is {what}; "
                               "drop it")
    if resolved.kind == "folder":
        assert resolved.path is not None
        return load_folder(resolved.path, resolved.spec, **model_kwargs)
    if resolved.kind == "file":
        assert resolved.path is not None
        return load_weights_file(resolved.path, resolved.spec, arch, **model_kwargs)
    assert resolved.name is not None
    model = _create(resolved.name, pretrained, resolved.spec, **model_kwargs)
    return Source(model, resolved.name, resolved.spec, pretrained)


def load_folder(folder: Path, spec: str, **model_kwargs: Any) -> Source:
    """A timm ``save_for_hf`` folder; a vitconvert folder is refused before its weights are read."""
    if not folder.is_dir():
        raise VitconvertError(f"folder not found: {folder}")
    cfg = read_config(folder)
    if (block := folder_block(cfg)) is not None:  # ours, or saved from one of ours by timm's save_for_hf
        # the recorded source, not only its architecture: the bundled digits teacher is a vit_tiny_patch16_224
        arch, recorded = source_architecture(cfg)[0], block.get("source")
        origin = f"{recorded}, a {arch}" if recorded and recorded != arch else arch
        raise LinearSourceError(f"{spec} is already a linear-attention vitconvert model, not a softmax source: give "
                                f"the softmax ViT it was converted from ({origin})")
    if "architecture" not in cfg:
        raise VitconvertError(f"{folder}/config.json has no 'architecture': not a timm model folder")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise VitconvertError(f"{folder} has config.json but no weights (model.safetensors)")
    check_weights_readable(folder)
    for weights in sorted(folder.glob("*.safetensors")):  # a student's weights under a softmax config.json
        check_softmax_weights(weights)
    model = _create(f"local-dir:{folder}", True, spec, **model_kwargs)
    return Source(model, cfg["architecture"], spec, True)


def config_beside(path: Path, spec: str) -> dict[str, Any]:
    """The timm config.json in the weights file's folder (``convert DIR/model.safetensors``), when it names the
    architecture (``architecture``, or its ``pretrained_cfg``'s); {} when there is none. A vitconvert folder's
    is refused as the folder itself is (its weights are a student's, not a softmax source)."""
    if not (path.parent / "config.json").is_file():
        return {}
    cfg = read_config(path.parent)
    if folder_block(cfg) is not None:
        load_folder(path.parent, spec)  # raises: already a linear-attention model, naming its source
    pretrained_cfg = cfg.get("pretrained_cfg") if isinstance(cfg.get("pretrained_cfg"), dict) else {}
    arch = cfg.get("architecture") or pretrained_cfg.get("architecture")
    if not isinstance(arch, str):
        return {}
    args = cfg.get("model_args") if isinstance(cfg.get("model_args"), dict) else {}
    return {"architecture": arch, "model_args": args, "pretrained_cfg": pretrained_cfg}


def load_weights_file(path: Path, spec: str, arch: Optional[str], **model_kwargs: Any) -> Source:
    """A bare weights file needs its timm architecture (``arch``); timm builds the model and its filter adapts the
    keys."""
    if path.suffix not in WEIGHT_SUFFIXES:
        raise VitconvertError(f"{path.name} is a file, not a model: give a model folder, a timm name, or a weights "
                              f"file ({', '.join(WEIGHT_SUFFIXES)})")
    beside: dict[str, Any] = {}
    if arch is None:
        beside = config_beside(path, spec)
        arch = beside.get("architecture")
    if arch is None:
        raise VitconvertError(f"{path.name} is a bare weights file with no architecture: name its timm "
                              f"architecture with {param('arch', 'NAME')}, or give the model folder it belongs to")
    name = resolve_alias(arch)
    if not timm.is_model(name):
        raise BadValue("arch", f"unknown architecture {arch!r}{suggest(arch)}")
    state = load_state_file(path)  # validates the file in one line before timm reads it
    check_softmax_weights(path)
    model_kwargs = {**(beside.get("model_args") or {}), **model_kwargs}  # the folder's sizes, as timm reads them
    overlay: dict[str, Any] = {**(beside.get("pretrained_cfg") or {}), "file": str(path)}
    head = state.get("head.weight")
    if head is not None and head.dim() == 2:
        overlay["num_classes"] = head.shape[0]
        model_kwargs.setdefault("num_classes", head.shape[0])
    model = _create(name, True, spec, pretrained_cfg_overlay=overlay, **model_kwargs)
    return Source(model, name, spec, True)
