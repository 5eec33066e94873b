"""MHLA's token blocks: how many per axis, the distance init of the block mixing W, and the layouts that cut a
row-major grid of tokens into (padded) blocks and back — for the eager form (reshapes and gathers), the fused
kernels (an index table of segments) and the literal reference (block of each token).

Row r of an h-row grid goes to block row ⌊r·M_h/h⌋ (likewise columns), so a grid the counts do not divide gets
blocks whose sides differ by at most one token; the layouts pad the shorter blocks.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
from torch.nn import functional as F

from .base import Grid

TRANSFORMS = ("cos", "linear", "exp", "local")


def resolve_block_counts(grid_size: Grid, blocks_per_side: Any, block_side: int) -> tuple[int, int]:
    """(M_h, M_w) blocks per axis: given, or chosen so that blocks of ``grid_size`` are ~block_side tokens wide."""
    if blocks_per_side is not None:
        counts = (blocks_per_side, blocks_per_side) if isinstance(blocks_per_side, int) else tuple(blocks_per_side)
        if len(counts) != 2 or min(counts) < 1:
            raise ValueError(f"blocks_per_side must be a positive int or a pair of them, got {blocks_per_side!r}")
        return int(counts[0]), int(counts[1])
    if grid_size is None:
        return 1, 1
    return tuple(max(1, math.floor(side / block_side + 0.5)) for side in grid_size)  # type: ignore[return-value]


def block_distances(counts: tuple[int, int]) -> torch.Tensor:
    """(M, M) Euclidean distances between block centres (i + ½, j + ½), blocks numbered row-major; on the CPU
    whatever the default device (a model built under ``torch.device("meta")`` still gets W's values)."""
    cpu = torch.device("cpu")
    rows, cols = torch.meshgrid(torch.arange(counts[0], device=cpu), torch.arange(counts[1], device=cpu),
                                indexing="ij")
    centres = torch.stack((rows.flatten(), cols.flatten()), dim=-1).double() + 0.5
    return torch.cdist(centres, centres)


def distance_weights(counts: tuple[int, int], transform: str = "cos", exp_sigma: float = 3.0,
                     local_threshold: float = 1.5) -> torch.Tensor:
    """The reference's init of W: a decreasing function of block distance, each column summing to one.

    Column b says how block b's state is spread over the readers a, so near blocks dominate and no block's
    state is amplified or lost in total.
    """
    dist = block_distances(counts)
    longest = dist.max() if dist.max() > 0 else torch.ones((), dtype=dist.dtype, device=dist.device)
    if transform == "cos":
        weights = torch.cos(dist / longest * math.pi / 4)
    elif transform == "linear":
        weights = 1.0 - dist / longest
    elif transform == "exp":
        weights = torch.exp(-dist / exp_sigma)
    elif transform == "local":
        weights = (dist <= local_threshold).double()
    else:
        raise ValueError(f"unknown transform {transform!r}; valid: {', '.join(TRANSFORMS)}")
    return weights / weights.sum(dim=0, keepdim=True)


def block_slot_lists(grid: tuple[int, int], counts: tuple[int, int]) -> tuple[list[int], list[int], int]:
    """(gather, slot, length) of :func:`block_layout` as lists of ints (loops TorchScript compiles too)."""
    h, w = grid
    mh, mw = counts
    block_of: list[int] = []
    for r in range(h):
        for c in range(w):
            block_of.append((r * mh // h) * mw + c * mw // w)
    sizes = [0] * (mh * mw)
    for b in block_of:
        sizes[b] += 1
    length = max(sizes)
    filled = [0] * (mh * mw)
    slot: list[int] = []
    for b in block_of:
        slot.append(b * length + filled[b])
        filled[b] += 1
    gather = [h * w] * (mh * mw * length)
    for token in range(len(slot)):
        gather[slot[token]] = token
    return gather, slot, length


@lru_cache(maxsize=32)
def block_slots(grid: tuple[int, int], counts: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(gather, slot, length) of :func:`block_layout` as plain ints (traceable by torch.compile, cached)."""
    gather, slot, length = block_slot_lists(grid, counts)
    return tuple(gather), tuple(slot), length


def block_layout(grid: tuple[int, int], counts: tuple[int, int], device: torch.device):
    """Index tensors that turn the row-major spatial tokens into padded blocks (M, L) and back.

    Returns ``gather`` (M·L,) token index of each block slot (h·w = the appended zero token for padding) and
    ``slot`` (h·w,) the slot of each token, so ``padded[..., gather, :]`` is blocked and ``blocked[..., slot, :]``
    is back in token order. Blocks of a non-divisible grid differ by one row or column, hence the padding.
    """
    gather, slot, length = (block_slots.__wrapped__ if torch.compiler.is_compiling() else block_slots)(
        tuple(grid), tuple(counts))
    return (torch.tensor(gather, dtype=torch.long, device=device),
            torch.tensor(slot, dtype=torch.long, device=device), length)


@lru_cache(maxsize=32)
def block_indices(grid: tuple[int, int], counts: tuple[int, int], device: torch.device):
    """(gather with padding -> token 0, real-slot mask, slot, length) on ``device``, built once per grid."""
    gather, slot, length = block_layout(grid, counts, device)
    spatial = grid[0] * grid[1]
    return gather.clamp(max=spatial - 1), gather < spatial, slot, length


def scripted_block_indices(grid: tuple[int, int], counts: tuple[int, int],
                           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`block_indices` under TorchScript (no cache there): the same lists, built per call."""
    gather_list, slot_list, length = block_slot_lists(grid, counts)
    gather = torch.tensor(gather_list, dtype=torch.long, device=device)
    slot = torch.tensor(slot_list, dtype=torch.long, device=device)
    spatial = grid[0] * grid[1]
    return gather.clamp(max=spatial - 1), gather < spatial, slot, length


def cached_block_indices(grid: tuple[int, int], counts: tuple[int, int],
                         device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`block_indices` from its cache in eager mode; traced afresh (constants) under torch.compile."""
    if torch.jit.is_scripting():
        return scripted_block_indices(grid, counts, device)
    else:
        return _cached_block_indices(grid, counts, device)


def _cached_block_indices(grid: tuple[int, int], counts: tuple[int, int], device: torch.device):
    if torch.compiler.is_compiling():
        return block_indices.__wrapped__(grid, counts, device)
    with torch.inference_mode(False):  # cached for later calls, which may record autograd (index_select saves it)
        return block_indices(grid, counts, device)


def to_blocks(t: torch.Tensor, grid: tuple[int, int], counts: tuple[int, int], zero_padding: bool) -> torch.Tensor:
    """(B, H, h·w, c) spatial tokens -> (B, H, M, L, c) blocks, in one copy.

    Divisible grids need only a reshape; otherwise one gather, whose padding slots repeat token 0 (harmless for
    queries, whose padding outputs are dropped) or, with ``zero_padding``, are zeroed (for the values side, so
    padding adds nothing to the block states).
    """
    B, H, _, c = t.shape
    h, w = grid
    mh, mw = counts
    if h % mh == 0 and w % mw == 0:
        blocks = t.reshape(B, H, mh, h // mh, mw, w // mw, c).transpose(3, 4)
        return blocks.reshape(B, H, mh * mw, (h // mh) * (w // mw), c)
    index, real, _, length = cached_block_indices(grid, counts, t.device)
    blocks = t.index_select(2, index).view(B, H, mh * mw, length, c)
    if zero_padding:
        blocks = blocks * real.to(t.dtype).view(mh * mw, length, 1)
    return blocks


@lru_cache(maxsize=32)
def _segment_lists(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int) -> tuple[tuple[int, ...], int]:
    gather, _, length = block_slot_lists(grid, counts)
    spatial = grid[0] * grid[1]
    rows = [[num_prefix + t if t < spatial else -1 for t in gather[b * length:(b + 1) * length]]
            for b in range(counts[0] * counts[1])]
    width = max(length, num_prefix, 1)
    rows = [row + [-1] * (width - len(row)) for row in rows]
    rows.append(list(range(num_prefix)) + [-1] * (width - num_prefix))
    return tuple(t for row in rows for t in row), width


def segment_index(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int,
                  device: torch.device) -> torch.Tensor:
    """(M + 1, L) int32 token indices of each block (row-major blocks), then of the prefix tokens; −1 pads.

    The segments of the fused kernels (ops/linear/op.py): block b's queries read Σ_s W̃[b, s] S_s. Built once
    per grid and device (a constant of the graph under torch.compile).
    """
    if torch.compiler.is_compiling():
        flat, width = _segment_lists.__wrapped__(grid, counts, num_prefix)
        return torch.tensor(flat, dtype=torch.int32, device=device).view(-1, width)
    return _cached_segment_index(grid, counts, num_prefix, device)


@lru_cache(maxsize=32)
def _cached_segment_index(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int,
                          device: torch.device) -> torch.Tensor:
    flat, width = _segment_lists(grid, counts, num_prefix)
    return _kept_table(flat, device).view(-1, width)


def _kept_table(values, device: torch.device) -> torch.Tensor:
    """An int32 table kept for later calls, made outside inference mode: the fused ops save their tables for
    backward, which refuses a tensor made in inference mode (a forward under torch.inference_mode, then a
    training step, failed on the blocked op's index)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.int32, device=device)


def token_segments(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int,
                   device: torch.device) -> torch.Tensor:
    """(N,) int32 segment of each token in token order: M (the prefix segment, last) for the prefix tokens, then
    each spatial token's block (:func:`reference_block_of`). The pairwise kernels' table (attention/
    ops/pairwise/op.py): the pair (i, j) weighs W̃[s(i), s(j)]. Built once per grid and device."""
    if torch.compiler.is_compiling():
        return torch.tensor(_token_segment_list(grid, counts, num_prefix), dtype=torch.int32, device=device)
    return _cached_token_segments(grid, counts, num_prefix, device)


def _token_segment_list(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int) -> list[int]:
    return [counts[0] * counts[1]] * num_prefix + reference_block_of(grid, counts)


@lru_cache(maxsize=32)
def _cached_token_segments(grid: tuple[int, int], counts: tuple[int, int], num_prefix: int,
                           device: torch.device) -> torch.Tensor:
    return _kept_table(_token_segment_list(grid, counts, num_prefix), device)


def extended_block_mix(block_mix: torch.Tensor) -> torch.Tensor:
    """W̃: W with a last row and column of ones (the prefix block reads and is read by every block)."""
    return F.pad(block_mix, (0, 1, 0, 1), value=1.0)


def from_blocks(t: torch.Tensor, grid: tuple[int, int], counts: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: (B, H, M, L, c) -> (B, H, h·w, c) in token order."""
    B, H, _, _, c = t.shape
    h, w = grid
    mh, mw = counts
    if h % mh == 0 and w % mw == 0:
        grid_order = t.reshape(B, H, mh, mw, h // mh, w // mw, c).transpose(3, 4)
        return grid_order.reshape(B, H, h * w, c)
    return t.flatten(2, 3).index_select(2, cached_block_indices(grid, counts, t.device)[2])


def reference_block_of(grid: tuple[int, int], counts: tuple[int, int]) -> list[int]:
    """Block of each spatial token, token by token: row r, column c -> block (⌊r·M_h/h⌋, ⌊c·M_w/w⌋)."""
    (h, w), (mh, mw) = grid, counts
    return [(r * mh // h) * mw + c * mw // w for r in range(h) for c in range(w)]
