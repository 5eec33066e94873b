"""model.safetensors as vitconvert writes it: one pass, tensors 64-byte aligned, and what the weights are.

- **Aligned.** transformers reads the file as zero-copy views of a memory map, and a matrix at an address that
  is not a multiple of 64 takes another GEMV path on some CPUs than the same matrix in memory of its own (1e-7
  off at batch 1). The format allows no gap between tensors, so the order does it: the header is padded with
  spaces (the format allows it) so the data starts on a 64-byte boundary, then every tensor whose size is a
  multiple of 64 bytes (every matrix and norm of a width divisible by 16), then the rest, matrices first. Only
  a tensor after another of such an odd size (a 1000-class bias) can start unaligned.
- **One pass.** The header, with the metadata, and then each tensor's bytes: no second write to add the mark.
- **The mark.** The metadata records the variant and which layers hold linear attention, so a config.json
  edited afterwards (elu to relu, another layer list), or a student's weights given as a softmax source, are
  refused by every reader instead of loaded into the wrong attention (``check_mark``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .errors import VitconvertError

ALIGNMENT = 64
LAYERS_KEY = "vitconvert_linear_layers"  # which layers hold linear attention (a JSON list)
VARIANT_KEY = "vitconvert_variant"

# torch dtype -> the safetensors header's name of it
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def nbytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor takes in the file."""
    return tensor.numel() * tensor.element_size()


def aligned_order(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The names in the order that starts the most tensors, every matrix first, on a 64-byte boundary."""
    whole = [k for k, t in state.items() if nbytes(t) % ALIGNMENT == 0]
    odd = sorted((k for k, t in state.items() if nbytes(t) % ALIGNMENT), key=lambda k: (state[k].dim() < 2,
                                                                                         -nbytes(state[k])))
    return whole + odd


def write_weights(path: Path, state: Mapping[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> None:
    """A safetensors file of ``state`` (read by safetensors, timm and transformers as any other), in one pass, its
    data 64-byte aligned (see the module's docstring). Assumes a little-endian machine, as torch does."""
    order = aligned_order(state)
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    start = 0
    for name in order:
        tensor = state[name]
        if tensor.dtype not in DTYPES:
            raise VitconvertError(f"cannot write {name}: safetensors has no {tensor.dtype}")
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [start, start + nbytes(tensor)]}
        start += nbytes(tensor)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for name in order:
            tensor = state[name].detach().to("cpu").contiguous().reshape(-1)
            fh.write(tensor.view(torch.uint8).numpy().data)


@dataclass(frozen=True)
class Mark:
    """What a weights file says it holds: the variant, and the layers with linear attention."""

    variant: Optional[str]
    layers: Optional[list[int]]


def read_mark(path: Path) -> Optional[Mark]:
    """The mark in ``path``'s metadata; None for a file vitconvert did not mark (written before the mark, by
    another program, or re-saved without it)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    if VARIANT_KEY not in meta and LAYERS_KEY not in meta:
        return None
    try:
        layers = json.loads(meta[LAYERS_KEY]) if LAYERS_KEY in meta else None
    except ValueError:
        layers = None
    return Mark(meta.get(VARIANT_KEY), layers if isinstance(layers, list) else None)


def block_mark(config_file: Path) -> Optional[Mark]:
    """The variant and linear layers a vitconvert config.json's block records: what weights re-saved without the
    mark (by another program) were saved as; None where there is no such block."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    block = config.get("vitconvert") if isinstance(config, dict) else None
    if not isinstance(block, dict):
        return None
    variant, layers = block.get("variant"), block.get("layers")
    return Mark(variant if isinstance(variant, str) else None, layers if isinstance(layers, list) else None)


def check_weights(path: Path, variant: str, layers: list[int], builder: str) -> None:
    """Refuse to load ``path`` into what ``builder`` builds (``variant`` attention in ``layers``) when the weights'
    mark says they are other weights; for weights without the mark, the vitconvert block of the config.json beside
    them says what they were saved as, and so it does for a pickle (timm's pytorch_model.bin, read weights_only),
    which holds no metadata. ELU, ReLU and softmax weights fit each other's modules: a strict load would take them
    without a word."""
    mark, teller = read_mark(path) if path.suffix == ".safetensors" else None, str(path)
    if mark is None:
        mark, teller = block_mark(path.parent / "config.json"), f"{path.parent / 'config.json'}'s vitconvert block"
    if mark is None:
        return
    wrong_variant = mark.variant is not None and mark.variant != variant
    if wrong_variant or (mark.layers is not None and mark.layers != layers):
        held = f"{mark.variant or variant} attention" + (f" in layers {mark.layers}" if mark.layers is not None else "")
        raise VitconvertError(f"{builder} builds {variant} attention in layers {layers}, but {teller} says the weights "
                              f"hold {held}: they would load into the wrong attention; restore config.json as "
                              "vitconvert wrote it")


def check_softmax_weights(path: Path) -> None:
    """Refuse a weights file vitconvert marked as a linear student where a softmax model is wanted (a source, a
    teacher): its attention weights fit the softmax modules, so timm would load it without a word."""
    if path.suffix != ".safetensors" or not path.is_file():
        return
    mark = read_mark(path)  # the callers have read the file once: it opens
    if mark is not None:
        layers = f" in layers {mark.layers}" if mark.layers is not None else ""
        raise VitconvertError(f"{path} holds vitconvert's {mark.variant} linear attention{layers} (a "
                              "converted model), not a softmax model's weights: give the softmax ViT it was converted "
                              "from")
