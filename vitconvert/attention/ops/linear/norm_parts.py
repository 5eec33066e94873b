"""The Triton piece of MHLA's q/k RMSNorm over heads in the blocked form's backward kernels (:mod:`.split_kernels`):
y = x̂·w with x̂ = x·rstd, rstd each token's 1/rms over all C = H·d channels (:func:`..norms.lean.rstd_over_heads`).

The kernels normalise q and k as their tiles load (:mod:`.kernel_parts`' ``rstd_at``, ``w``) and store g = ∂L/∂y of
each head's tile where dq or dk goes. The raw gradient dx = rstd·(g·w − x̂·Σ_c g·w·x̂ / C) needs every head's channels
of a token, so it is taken by the last of the H programs that share a token range (an integer ticket, as the
pairwise backward's norm tail): q's by the read-out's backward, k's by the state's backward, in place, each sum in a
fixed order (no float atomics). A per-token share written by every program would save the tail's first reading pass
(in L2 or L1 by then: the range's tiles were just written) but took the read-out's backward loop many more registers
(docs/performance.md, MHLA's blocked form). The weights' gradient Σ_t g·x̂ is stored as a row of H·d floats per
range and summed over the ranges by torch after the last launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel_parts import _tokens


@triton.jit
def _norm_tile(x_base, g_base, s_xn, s_gn, tok, tile, d, rstd, w_at, d_ok):
    """(x̂, g, w) of one head's tile of tokens ``tok``, float32; g from L2 (``.cg``: other programs wrote it)."""
    x = tl.load(x_base + tok[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    g = tl.load(g_base + tok[:, None] * s_gn + d[None, :], mask=tile, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x * rstd[:, None], g, tl.load(w_at + d, mask=d_ok, other=0.0)


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
