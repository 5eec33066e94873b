"""The Triton pieces of MHLA's blocked form that the split kernels (:mod:`.split_kernels`) run in their last
programs and epilogues, so no torch op runs between the op's launches (2 forward, 3 backward):

- W̃'s mixing of the block states, R_a = Σ_s W̃[a, s] S_s and r_a = Σ_s W̃[a, s] z_s, by the last of a batch·head's
  state programs (:func:`mix_states`);
- its backward, dS_s = Σ_a W̃[a, s] dR_a, dz_s likewise and this batch·head's dW̃[a, s] = dR_a·S_s + dr_a·z_s, by the
  last of its read-out backward programs (:func:`mix_gradients`);
- LePE's backward on the keys of a state backward chunk: dv's taps of do and, from the same shifted tiles of do, the
  chunk's share of the filter's gradient (:func:`lepe_key_taps`), summed over a batch·head's chunks in order by its
  last program (:func:`lepe_filter_total`), then over the batch by the last batch·head's (:func:`lepe_batch_total`).

Every segment's state is a row [S_s | z_s] of D·D + D floats; a batch·head's G rows are mixed MIX_CHUNK columns at
a time into a (BLOCK_G, MIX_CHUNK) float32 tile (G ≤ BLOCK_G), one multiply-add a segment in a fixed order, so each
state is read once (float32 dots of W̃ spill: their operands are held whole). The rows of the token ranges' partial
sums are summed first, in their order. MIX_CHUNK is the launch's (:func:`.launches.mix_chunk`). W̃ is read as
given (GW×GW, its dtype): GW = G, or G − 1 with the last segment's row and column ones (MHLA's class token,
:func:`...blocks.extended_block_mix`), made as it loads (:func:`_mixing_column`), so the module pads nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import _position, _row, _source
from .tickets import _last_program, _rows_total, _ticket_back


@triton.jit
def _segment_row(P, first, s, SPLITS, width, c, c_ok):
    """Row [S_s | z_s] (columns ``c``) of segment s of a batch·head: its rows ``first + s·SPLITS + p`` (of ``width``
    floats) summed over the p < SPLITS token ranges in order, from L2 (``.cg``: other programs wrote them)."""
    at = P + (first + s * SPLITS) * width + c
    total = tl.zeros(c.shape, dtype=tl.float32)
    for p in range(0, SPLITS):
        total += tl.load(at + p * width, mask=c_ok, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_rows(S, SZ, which, x, c, D):
    """Columns ``c`` of rows [S | z] ``which`` into a (…, D, D) and a (…, D) float32 tensor: ``which`` (BLOCK_G,)
    (masked, -1 past G) with ``x`` (BLOCK_G, CHUNK), or one row."""
    square = (which >= 0) & (c < D * D)
    tl.store(S + which * D * D + c, x, mask=square)
    tl.store(SZ + which * D + c - D * D, x, mask=(which >= 0) & (c >= D * D) & (c < D * D + D))


@triton.jit
def mixing_entries(W, a, s, GW):
    """W̃[a, s] (``a`` and ``s`` broadcast), float32, from W as given (GW × GW, its dtype): W's entry, or one where
    a or s is GW (MHLA's class token: W̃'s last row and column of ones, :func:`...blocks.extended_block_mix`,
    made as W loads, so the module pads nothing). The one home of W̃'s entries for the blocked form's mixing
    (:func:`_mixing_column`) and the pairwise form's weights (ops/pairwise/kernels.py)."""
    return tl.load(W + a * GW + s, mask=(a < GW) & (s < GW), other=1.0).to(tl.float32)


@triton.jit
def _mixing_column(W, g, s, G, GW):
    """W̃[g, s] over the rows ``g`` (zero past G), float32: W's entry, or one in the last row and column where W is
    (G − 1)×(G − 1) (GW = G − 1)."""
    return tl.where(g < G, mixing_entries(W, g, s, GW), 0.0)


@triton.jit
def mix_states(PART, W, R, RZ, bh, G, GW, SPLITS, width, D, keep, BLOCK_G: tl.constexpr, MIX_CHUNK: tl.constexpr):
    """R_a, r_a of every segment a of batch·head ``bh`` (R (…, D, D), RZ (…, D) float32) from its segments' partial
    states (PART: rows of ``width`` floats, [S | z] first), summed over the token ranges and mixed by W̃ (GW × GW)
    in a fixed order (s = 0, 1, …: a multiply-add a segment, no dot). ``keep``: each segment's summed state
    also written to its first row (the backward's dW̃ reads it)."""
    g = tl.arange(0, BLOCK_G)
    which = tl.where(g < G, bh * G + g, -1)
    first = bh * G * SPLITS
    for start in range(0, D * D + D, MIX_CHUNK):
        c = start + tl.arange(0, MIX_CHUNK)
        c_ok = c < D * D + D
        mixed = tl.zeros((BLOCK_G, MIX_CHUNK), dtype=tl.float32)
        for s in range(0, G):
            state = _segment_row(PART, first, s, SPLITS, width, c, c_ok)
            if keep and SPLITS > 1:
                tl.store(PART + (first + s * SPLITS) * width + c, state, mask=c_ok)
            mixed += _mixing_column(W, g, s, G, GW)[:, None] * state[None, :]
        _store_rows(R, RZ, which[:, None], mixed, c[None, :], D)


@triton.jit
def mix_gradients(PART, STATES, W, DS, DZ, DW, bh, G, GW, SPLITS, width, state_width, D, BLOCK_G: tl.constexpr,
                  MIX_CHUNK: tl.constexpr):
    """dS_s, dz_s of every segment s of batch·head ``bh`` (DS, DZ as :func:`mix_states`' R, RZ) from the partial dR_a,
    dr_a of its read-out programs (PART: rows of ``width`` floats), summed over the token ranges in order and mixed
    by W̃ᵀ; and this batch·head's dW̃ (a row of DW: GW·GW float32) against the states :func:`mix_states` kept
    (STATES: each segment's first row of ``state_width`` floats)."""
    g = tl.arange(0, BLOCK_G)
    first = bh * G * SPLITS
    dw = tl.zeros((BLOCK_G, BLOCK_G), dtype=tl.float32)
    for start in range(0, D * D + D, MIX_CHUNK):
        c = start + tl.arange(0, MIX_CHUNK)
        c_ok = c < D * D + D
        grads = tl.zeros((BLOCK_G, MIX_CHUNK), dtype=tl.float32)
        for a in range(0, G):  # (every dR_a, summed over its token ranges)
            grads = tl.where(g[:, None] == a, _segment_row(PART, first, a, SPLITS, width, c, c_ok)[None, :], grads)
        for s in range(0, G):
            state = tl.load(STATES + (first + s * SPLITS) * state_width + c, mask=c_ok, other=0.0)
            dw = tl.where(g[None, :] == s, dw + tl.sum(grads * state[None, :], axis=1)[:, None], dw)
            w = _mixing_column(W, g, s, G, GW)  # (W̃[a, s] over a)
            _store_rows(DS, DZ, bh * G + s, tl.sum(w[:, None] * grads, axis=0), c, D)
    given = g < GW
    tl.store(DW + bh * GW * GW + g[:, None] * GW + g[None, :], dw, mask=given[:, None] & given[None, :])


@triton.jit
def lepe_key_taps(g_at, s_gn, v, tok, inside, d, d_ok, LW, LPART, out, MASK, s_mb, b, h, D, P, ROWS, COLS,
                  KS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """LePE's backward at the key tokens ``tok`` of a state backward chunk (o = attention + bias + Σ_tap
    w[tap]·(v·m) shifted, over the ROWS×COLS grid after P prefix tokens; ``v``: the chunk's v as the state backward
    loaded it). Returns dv's part, m_j·Σ_tap w[tap]·do_{j − off(tap)}, and stores the chunk's share of the filter's
    gradient as row ``out`` of LPART ((KS·KS + 1)·D floats): row tap Σ_j (v·m)_j·do_{j − off(tap)}, row KS·KS (the
    bias) Σ over grid tokens j of do_j. Each shifted tile of do is loaded once for both, and a row per chunk keeps
    no accumulator of the taps beside the d×d tiles (benchmarks/kernel_resources.py --arch)."""
    spatial, row, col = _position(tok, P, P + ROWS * COLS, COLS)
    spatial = spatial & inside
    valid = spatial
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * s_mb + tok, mask=inside, other=0) != 0)
    v = v.to(tl.float32)
    g_rows, weights, share = g_at + d[None, :], LW + (h * D + d) * (KS * KS), LPART + out * (KS * KS + 1) * D + d
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for i in range(KS):  # (loops, as the grid op's backward: unrolled taps spill)
        r_in, in_ok = _row(valid, row, KS // 2 - i, ROWS)  # (the grid tokens whose taps (i, ·) read these)
        for j in range(KS):
            src, ok = _source(MASK, b, s_mb, r_in, in_ok, col, KS // 2 - j, P, COLS, False)
            g = tl.load(g_rows + src[:, None] * s_gn, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            dv += g * tl.load(weights + i * KS + j, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(share + (i * KS + j) * D, tl.sum(g * v, axis=0), mask=d_ok)
    own = tl.load(g_rows + tok[:, None] * s_gn, mask=spatial[:, None] & d_ok[None, :], other=0.0)
    tl.store(share + KS * KS * D, tl.sum(own.to(tl.float32), axis=0), mask=d_ok)
    return dv


@triton.jit
def lepe_filter_total(LPART, DLW, DLB, bh, SEGMENTS, SPLITS, CHUNKS, per, L, d, d_ok, D, KS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """The last program's sum of a batch·head's rows of LePE's filter gradient (:func:`lepe_key_taps`: CHUNKS rows
    for each of its SEGMENTS·SPLITS programs, the first of them written, one a chunk of its ``per`` tokens below L),
    in their order, stored in the weight's layout: DLW (B·H, D, KS·KS) and DLB (B·H, D) float32 (the batch summed by
    torch after)."""
    taps = tl.arange(0, BLOCK_T)
    width = (KS * KS + 1) * D
    at = LPART + bh * SEGMENTS * SPLITS * CHUNKS * width + taps[:, None] * D + d[None, :]
    total = tl.zeros((BLOCK_T, d.shape[0]), dtype=tl.float32)
    for p in range(0, SEGMENTS * SPLITS):
        tokens = tl.maximum(tl.minimum(per, L - (p % SPLITS) * per), 0)
        for c in range(0, (tokens + BLOCK_N - 1) // BLOCK_N):
            total += tl.load(at + (p * CHUNKS + c) * width, mask=(taps[:, None] <= KS * KS) & d_ok[None, :],
                             other=0.0, cache_modifier=".cg")
    tl.store(DLW + bh * D * KS * KS + d[None, :] * (KS * KS) + taps[:, None], total,
             mask=(taps[:, None] < KS * KS) & d_ok[None, :])
    tl.store(DLB + bh * D + d[None, :] + 0 * taps[:, None], total, mask=(taps[:, None] == KS * KS) & d_ok[None, :])


@triton.jit
def lepe_batch_total(DLW, DLB, LWG, LBG, COUNTER, which, B, H, D, KS: tl.constexpr, BLOCK: tl.constexpr):
    """After a batch·head's filter gradient is in DLW, DLB (:func:`lepe_filter_total`, or the pairwise backward's
    :func:`..grid.kernels.conv_weight_taps`), the last of the B·H (a ticket at COUNTER + ``which``) sums them over
    the batch in order (an image's H·D·KS·KS and H·D floats are one row) into LWG (H·D, KS·KS) and LBG (H·D) in
    their dtype (the weight's): its gradient, no torch op after the launch."""
    if _last_program(COUNTER, which, B * H):
        _rows_total(DLW, 0, B, H * D * KS * KS, LWG, BLOCK)
        _rows_total(DLB, 0, B, H * D, LBG, BLOCK)
        _ticket_back(COUNTER, which)
