"""Which attention layers go linear: ``--layers 2-11`` / ``--keep-softmax 0,1`` (or ``auto:K``) -> indices.

Layers are counted in model order (``blocks.0.attn`` is layer 0); a hybrid student swaps only the chosen
ones and keeps the teacher's softmax module and weights in the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional, Union

from .errors import BadValue

Spec = Union[str, Iterable[int], None]
AUTO = "auto:"


def parse_indices(spec: Union[str, Iterable[int]], depth: int, name: str,
                  names: Sequence[str] = ()) -> list[int]:
    """``"0,2-4"``, ``[0, 2, 3, 4]`` or module names (``"blocks.0,blocks.5.attn"``, given the attention modules'
    ``names`` in order) -> sorted unique layer indices, each in 0..depth-1."""
    if isinstance(spec, str):
        found: list[int] = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            matches = [i for i, n in enumerate(names) if part in (n, n.rpartition(".")[0])]
            if matches:
                found.extend(matches)
                continue
            first, dash, last = part.partition("-")
            if not first.strip().isdigit() or (dash and not last.strip().isdigit()):
                raise BadValue(name, f"expects layer indices like 0,1 or 2-11 (or module names like "
                                     f"{names[0] if names else 'blocks.0.attn'}), got {spec!r}")
            lo, hi = int(first), int(last) if dash else int(first)
            if hi < lo:
                raise BadValue(name, f"range {part!r} runs backwards")
            found.extend(range(lo, hi + 1))
    else:
        found = [int(i) for i in spec]
    if not found:
        raise BadValue(name, f"names no layer (got {spec!r})")
    bad = [i for i in found if not 0 <= i < depth]
    if bad:
        raise BadValue(name, f"layer {bad[0]} does not exist: the model has {depth} attention layers (0-{depth - 1})")
    return sorted(set(found))


def auto_count(spec: Spec) -> Optional[int]:
    """K of ``"auto:K"`` (None for any other spec)."""
    if not isinstance(spec, str) or not spec.strip().startswith(AUTO):
        return None
    k = spec.strip()[len(AUTO):]
    if not k.isdigit():
        raise BadValue("keep_softmax", f"expects auto:K with K a number of layers, got {spec!r}")
    return int(k)


def linear_layers(depth: int, layers: Spec = None, keep_softmax: Spec = None, names: Sequence[str] = ()) -> list[int]:
    """The layers to swap: ``layers`` as given, or every layer but ``keep_softmax``, or all of them; ``names``:
    the attention modules' names in order, so a spec may name them."""
    if layers is not None and keep_softmax is not None:
        raise BadValue("keep_softmax", "give either the layers to swap or the ones to keep softmax, not both")
    if auto_count(keep_softmax) is not None:
        raise BadValue("keep_softmax", "auto:K is chosen from data: resolve it first (vitconvert.hybrid."
                                       "choose_softmax_layers), or convert with vitconvert.convert_source, which "
                                       "does")
    if layers is not None:
        return parse_indices(layers, depth, "layers", names)
    if keep_softmax is not None:
        kept = set(parse_indices(keep_softmax, depth, "keep_softmax", names)) if not _empty(keep_softmax) else set()
        chosen = [i for i in range(depth) if i not in kept]
        return chosen
    return list(range(depth))


def _empty(spec: Spec) -> bool:
    return (isinstance(spec, str) and not spec.strip()) or (not isinstance(spec, str) and not list(spec or []))


def describe(linear: Sequence[int], depth: int) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4,7"``; every layer -> ``"all"``."""
    if list(linear) == list(range(depth)):
        return "all"
    if not linear:
        return "none"
    parts, start = [], linear[0]
    for prev, cur in zip(linear, [*linear[1:], None], strict=True):
        if cur is None or cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ",".join(parts)
