"""A weights file a user gives (``--arch`` with a file, a timm checkpoint, timm's pickled ``save_for_hf``): its
tensors, from safetensors or from a torch file read with ``weights_only=True``, never unpickled, since unpickling
runs the file's code. One home for the sources that read such files and for the model folder's ``upgrade``."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import VitconvertError, unreadable_file


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
        garbage = "Unsupported operand" in str(e)  # bytes that are no pickle at all: a damaged or foreign file
        if "Weights only load failed" in str(e) and not garbage:  # torch's first line is cut before its reason
            raise VitconvertError(f"{path} is a pickle of more than tensors (a whole model or training objects): "
                                  "vitconvert never unpickles a file, as that runs its code; save the model's "
                                  "state_dict() (or use safetensors) and give that") from None
        kind = "safetensors" if path.suffix == ".safetensors" else "torch weights file"
        raise unreadable_file(path, ValueError("not a torch file") if garbage else e, kind) from None
    for key in ("state_dict", "model", "model_ema", "module"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VitconvertError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}
