"""The Triton pieces of MHLA's q/k RMSNorm over heads in the blocked form's kernels (:mod:`.split_kernels`) and the
pairwise ones: y = x̂·w with x̂ = x·rstd, rstd each token's 1/rms over all C = H·d channels.

Forward, each token's rstd is taken by the kernels that already read q and k, as their tiles load
(:func:`.kernel_parts._token_rstd`): a state program sums the squares of its chunk's keys over every head's tile of
them (a head at a time), then uses its own head's tile as before, and the read-out's programs likewise for q. φ is
nonlinear, so a state needs each key's k̂ (the rstd over every head) before it sums φ(k̂)vᵀ: the extra reads are
the other heads' tiles of the same tokens, and the programs of a token range's heads are adjacent in the grid
(axis 0 is batch·head) and run together, so on a GPU they are L2 hits of tiles a neighbour reads anyway, where a
launch of its own read q and k once more from HBM. The head-0 program of each (image, token range) stores the rstd
rows (2, B, N) that backward reads (no race: the others only use the value they took).

The kernels normalise q and k as their tiles load (:mod:`.kernel_parts`' ``rstd_at``, ``w``) and store g = ∂L/∂y of
each head's tile where dq or dk goes. The raw gradient dx = rstd·(g·w − x̂·Σ_c g·w·x̂ / C) needs every head's channels
of a token, so it is taken by the last of the H programs that share a token range (an integer ticket, as the
pairwise backward's norm tail): q's by the read-out's backward, k's by the state's backward, in place, each sum in a
fixed order (no float atomics). A per-token share written by every program would save the tail's first reading pass
(in L2 or L1 by then: the range's tiles were just written) but took the read-out's backward loop many more registers
(docs/performance.md, MHLA's blocked form). The weights' gradient Σ_t g·x̂ is stored as a row of H·d floats per
range, summed over an image's ranges and then the batch by last programs (:func:`.tickets.batch_total`).
The weights are read as they are (any dtype, unpadded: masked past the last head's channels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import _tokens
from .tickets import _last_program, _ticket_back, batch_total


@triton.jit
def _norm_tile(x_base, g_base, s_xn, s_gn, tok, tile, d, rstd, w_at, d_ok):
    """(x̂, g, w) of one head's tile of tokens ``tok``, float32; g from L2 (``.cg``: other programs wrote it)."""
    x = tl.load(x_base + tok[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    g = tl.load(g_base + tok[:, None] * s_gn + d[None, :], mask=tile, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x * rstd[:, None], g, tl.load(w_at + d, mask=d_ok, other=0.0).to(tl.float32)


@triton.jit
def norm_backward_tokens(x_at, s_xh, s_xn, g_at, s_gh, s_gn, tok, inside, rstd_at, NW, H, D, d, d_ok, heads, dw):
    """The norm's backward at every head of tokens ``tok`` (``inside``: real ones), once every head's g is stored
    (x_at, g_at: the image's head 0 of the raw x and of g): dx = rstd·(g·w − x̂·Σ_c g·w·x̂ / C) over g in place, the
    sum over all C = H·D channels of a token taken first over every head in a fixed order; returns ``dw`` (a row a
    head) plus these tokens' Σ_t g·x̂. The one home of this math for the blocked tail (:func:`norm_tail`) and the
    pairwise one (ops/pairwise/kernels.py)."""
    tile = inside[:, None] & d_ok[None, :]
    rstd = tl.load(rstd_at + tok, mask=inside, other=0.0)
    total = tl.zeros(tok.shape, dtype=tl.float32)
    for head in range(0, H):  # (a fixed order: the same sum for every head)
        x_hat, g, w = _norm_tile(x_at + head * s_xh, g_at + head * s_gh, s_xn, s_gn, tok, tile, d, rstd,
                                 NW + head * D, d_ok)
        total += tl.sum(g * w[None, :] * x_hat, axis=1)
    for head in range(0, H):
        x_hat, g, w = _norm_tile(x_at + head * s_xh, g_at + head * s_gh, s_xn, s_gn, tok, tile, d, rstd,
                                 NW + head * D, d_ok)
        dx = rstd[:, None] * (g * w[None, :] - x_hat * (total / (H * D))[:, None])
        tl.store(g_at + head * s_gh + tok[:, None] * s_gn + d[None, :], dx.to(g_at.dtype.element_ty), mask=tile)
        dw += tl.where(heads[:, None] == head, tl.sum(g * x_hat, axis=0)[None, :], 0.0)
    return dw


@triton.jit
def norm_tail(x_at, s_xh, s_xn, g_at, s_gh, s_gn, IDX, seg, L, begin, end, rstd_at, NW, DW, out, H, D, d, d_ok,
              HAS_INDEX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """The norm's backward at every head of the tokens of one range (begin..end of segment ``seg``), once every
    head's g is stored (x_at, g_at: the image's head 0 of the raw q or k and of the g in dq or dk): dx over g in g's
    dtype, and the range's Σ_t g·x̂ of every head as row ``out`` of DW (H·D floats)."""
    heads = tl.arange(0, BLOCK_H)
    dw = tl.zeros((BLOCK_H, d.shape[0]), dtype=tl.float32)  # (each head's row, summed over the chunks in order)
    for start in range(begin, end, BLOCK_N):
        tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
        dw = norm_backward_tokens(x_at, s_xh, s_xn, g_at, s_gh, s_gn, tok, inside, rstd_at, NW, H, D, d, d_ok,
                                  heads, dw)
    tl.store(DW + out * H * D + heads[:, None] * D + d[None, :], dw, mask=(heads[:, None] < H) & d_ok[None, :])


@triton.jit
def norm_backward(x_at, s_xh, s_xn, g_at, s_gh, s_gn, IDX, seg, L, begin, end, rstd_at, NW, DNW, NCOUNTER, NWG, b,
                  H, D, SEGMENTS, SPLITS, split, d, d_ok, HAS_INDEX: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The norm's backward of a token range by the last of the image's H programs that share it (a ticket at
    NCOUNTER + its range), which stores the range's row of the weight's gradient (DNW: B·ranges rows of H·D floats,
    then B of scratch); the rows summed over the batch into NWG by last programs (the tickets after the ranges':
    :func:`.tickets.batch_total`)."""
    span = (b * SEGMENTS + seg) * SPLITS + split
    if _last_program(NCOUNTER, span, H):
        norm_tail(x_at, s_xh, s_xn, g_at, s_gh, s_gn, IDX, seg, L, begin, end, rstd_at, NW, DNW, span, H, D, d, d_ok,
                  HAS_INDEX, BLOCK_N, BLOCK_H)
        _ticket_back(NCOUNTER, span)
        batch, ranges = tl.num_programs(0) // H, SEGMENTS * SPLITS
        batch_total(DNW, NCOUNTER + batch * ranges, b, batch, ranges, H * D, NWG, BLOCK_H * BLOCK_D)
