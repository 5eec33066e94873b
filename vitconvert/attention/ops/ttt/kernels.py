"""Triton kernels of TTT's closed-form step (attention/ttt.py) forward: the inner gradients and the read-out of the
updated model; their backward is :mod:`.backward_kernels`.

Per (batch, head), with k the normalised and convolved keys, a = kW1, b = kW2, act = silu(a), u = vW3ᵀ:

    Ĝ1 = Σ_j k_jᵀ (u ⊙ b ⊙ silu'(a))_j,   Ĝ2 = Σ_j k_jᵀ (u ⊙ act)_j,   Ĝ3 = Σ_j (act ⊙ b)_jᵀ v_j

are the inner loss's gradients before its −s/N factor (the d×d sums are scaled, so nothing N-sized is scaled and
float16 does not underflow), W' = W − lr·(−s/N)·Ĝ, and every query reads

    o_i = (silu(q_i W1') ⊙ (q_i W2')) W3'.

Each program owns one (batch·head, token range) and walks it in chunks of BLOCK_N tokens; the token-sized
intermediates (a, b, silu, its derivative, u) live in float32 registers only, the dots run as the linear-attention
kernels' (ops/linear/kernel_parts.py: TILE operands, float32 accumulators). Where one program sums a head's tokens,
:func:`ttt_fwd_kernel` forms W' in registers and reads the queries out in the same program (W' never crosses
memory); where heads split over token ranges, :func:`inner_sums_kernel` writes partial sums, the last program of
each batch·head sums them and forms W' (a ticket: ops/linear/tickets.py), and :func:`swiglu_readout_kernel` reads
it. Masked keys load as zero rows of k and v, which add nothing to any sum.

The keys come raw (``K_CONV``: the keys' instance norm, its statistics (2, B, H, D) float32 formed by
:func:`ttt_fwd_kernel` itself or, split, from the caller, and their residual 3×3 depthwise conv applied as each tile
loads, :func:`_keys`) or already normalised and convolved;
q's conv likewise (``CONV``, :func:`_queries`): neither convolved tensor crosses memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import _statistics, conv_taps, key_statistics
from ..linear.kernel_parts import _dot, _load_square, _store_square
from ..linear.tickets import _last_program, _summed, _ticket_back


@triton.jit
def _three(P, first, d, d_ok, D):
    """Matrices first, first + 1, first + 2 of a stack of (D, D) float32 ones ([W1', W2', W3'] or gradients)."""
    return (_load_square(P, first, d, d_ok, D), _load_square(P, first + 1, d, d_ok, D),
            _load_square(P, first + 2, d, d_ok, D))


@triton.jit
def _initial(W1, W2, W3, h, d, d_ok, D):
    """W1, W2, W3 of head h in float32, each from its own (H, D, D) tensor: the module's parameters as they are
    (no stacked copy), whose gradients are then three tensors of their own."""
    return (_load_square(W1, h, d, d_ok, D).to(tl.float32), _load_square(W2, h, d, d_ok, D).to(tl.float32),
            _load_square(W3, h, d, d_ok, D).to(tl.float32))


@triton.jit
def _step_of(MASK, s_mb, b_, step, N, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """lr·s/n of batch b_: ``step`` (lr·s/N, a float) without a mask; with one, ``step`` is lr·s and n its image's
    valid keys, at least 1 (:func:`..layout.valid_keys`), counted here from its mask row: no torch op per call."""
    s = step
    if HAS_MASK:
        n = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for start in range(0, N, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)
            n += (tl.load(MASK + b_ * s_mb + tok, mask=tok < N, other=0) != 0).to(tl.int32)
        s = step / tl.maximum(tl.sum(n, axis=0), 1).to(tl.float32)
    return s


@triton.jit
def _put_partials(P, bh, split, SPLITS, x1, x2, x3, d, d_ok, D):
    """One program's three partial sums into a (BH, 3, SPLITS, D, D) float32 stack (the last program sums them)."""
    first = bh * 3 * SPLITS + split
    _store_square(P, first, x1, d, d_ok, D)
    _store_square(P, first + SPLITS, x2, d, d_ok, D)
    _store_square(P, first + 2 * SPLITS, x3, d, d_ok, D)


@triton.jit
def _program(H, N, D, tokens_per_split, BLOCK_D: tl.constexpr):
    """This program's (batch·head, token range, batch, head, head-dim index, its validity, first token, end)."""
    bh, split = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    begin = split * tokens_per_split
    return bh, split, bh // H, bh % H, d, d < D, begin, tl.minimum(begin + tokens_per_split, N)


@triton.jit
def _rows(base, tok, tile, d, stride):
    """One chunk of token rows in float32, zero outside ``tile``."""
    return tl.load(base + tok[:, None] * stride + d[None, :], mask=tile, other=0.0).to(tl.float32)


@triton.jit
def _queries(q_base, tok, tile, d, d_ok, s_qn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS,
             CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """One chunk of query rows in float32, zero outside ``tile``; with ``CONV`` TTT's residual 3×3 depthwise conv
    of q on the grid (QW: (H·D, 9) filters, QB its bias, read as float32) added as the tile loads."""
    q = _rows(q_base, tok, tile, d, s_qn)
    if CONV:
        none = tl.zeros_like(d).to(tl.float32)
        q = tl.where(tile, q + conv_taps(q_base, s_qn, tok, d, d_ok, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS,
                                         none, none, 3, False, HAS_BIAS, HAS_MASK, BLOCK_N, BLOCK_D), 0.0)
    return q


@triton.jit
def _keys(k_base, tok, tile, d, d_ok, s_kn, KW, KB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, mean, rstd,
          K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_D: tl.constexpr):
    """One chunk of key rows in float32, zero outside ``tile``; with ``K_CONV`` k̂ + conv(k̂·m) of the raw keys,
    k̂ = (k − μ)·r their instance norm (``mean``, ``rstd`` per channel), as ops/grid's kernel forms it."""
    k = _rows(k_base, tok, tile, d, s_kn)
    if K_CONV:
        k = tl.where(tile, (k - mean[None, :]) * rstd[None, :]
                     + conv_taps(k_base, s_kn, tok, d, d_ok, KW, KB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, mean,
                                 rstd, 3, True, K_BIAS, HAS_MASK, BLOCK_N, BLOCK_D), 0.0)
    return k


@triton.jit
def _chunk(start, end, MASK_ROW, d_ok, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """(token index, valid rows, valid tile) of one chunk below ``end``."""
    tok = start + tl.arange(0, BLOCK_N)
    ok = tok < end
    if HAS_MASK:
        ok = ok & (tl.load(MASK_ROW + tok, mask=ok, other=0) != 0)
    return tok, ok, ok[:, None] & d_ok[None, :]


@triton.jit
def _swiglu_parts(x, w1, w2, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """a = xW1, b = xW2, σ(a), silu(a) and silu'(a) = silu + σ(1 − silu), float32."""
    xt = x.to(TILE)
    a = _dot(xt, w1, PRECISION, EMULATE)
    b = _dot(xt, w2, PRECISION, EMULATE)
    sig = tl.sigmoid(a)
    act = a * sig
    return a, b, sig, act, act + sig * (1.0 - act)


@triton.jit
def _key_chunk(k_base, v_base, MASK, s_mb, b_, h, start, end, d, d_ok, s_kn, s_vn, w1, w2, w3_t, KW, KB, N, D, P,
               ROWS, COLS, mean, rstd, K_CONV: tl.constexpr, K_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
               EMULATE: tl.constexpr):
    """One chunk of keys (:func:`_keys`) and values (masked keys as zero rows) and what the inner gradients make of
    them: (token index, tile, k, v in the tile dtype, a, b, σ(a), silu(a), silu'(a), u = vW3ᵀ)."""
    tok, _, tile = _chunk(start, end, MASK + b_ * s_mb, d_ok, BLOCK_N, HAS_MASK)
    k = _keys(k_base, tok, tile, d, d_ok, s_kn, KW, KB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, mean, rstd, K_CONV,
              K_BIAS, HAS_MASK, BLOCK_N, BLOCK_D)
    v = _rows(v_base, tok, tile, d, s_vn).to(TILE)
    a, b, sig, act, dsilu = _swiglu_parts(k, w1, w2, TILE, PRECISION, EMULATE)
    return tok, tile, k.to(TILE), v, a, b, sig, act, dsilu, _dot(v, w3_t, PRECISION, EMULATE)


@triton.jit
def key_sums(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, N, D, P, ROWS,
             COLS, b_, h, d, d_ok, begin, end, K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
             EMULATE: tl.constexpr):
    """Ĝ1, Ĝ2, Ĝ3 (float32) over the keys begin..end of batch b_, head h (``mean``, ``rstd``: the keys'
    statistics with ``K_CONV``)."""
    w1, w2, w3 = _initial(W1, W2, W3, h, d, d_ok, D)
    w1, w2, w3_t = w1.to(TILE), w2.to(TILE), tl.trans(w3).to(TILE)
    g1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    g2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    g3 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    k_base, v_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh
    for start in range(begin, end, BLOCK_N):
        _, _, k, v, _, b, _, act, dsilu, u = _key_chunk(k_base, v_base, MASK, s_mb, b_, h, start, end, d, d_ok, s_kn,
                                                        s_vn, w1, w2, w3_t, KW, KB, N, D, P, ROWS, COLS, mean, rstd,
                                                        K_CONV, K_BIAS, BLOCK_N, BLOCK_D, HAS_MASK, TILE, PRECISION,
                                                        EMULATE)
        kt = tl.trans(k)
        g1 += _dot(kt, (u * b * dsilu).to(TILE), PRECISION, EMULATE)
        g2 += _dot(kt, (u * act).to(TILE), PRECISION, EMULATE)
        g3 += _dot(tl.trans((act * b).to(TILE)), v, PRECISION, EMULATE)
    return g1, g2, g3


@triton.jit
def updated_weights(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb,
                    step, N, D, P, ROWS, COLS, b_, h, d, d_ok, K_CONV: tl.constexpr, K_BIAS: tl.constexpr,
                    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                    PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """W' = W + step·Ĝ (float32) of batch b_, head h from all its keys: one program's (:func:`_step_of`)."""
    g1, g2, g3 = key_sums(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, N, D,
                          P, ROWS, COLS, b_, h, d, d_ok, 0, N, K_CONV, K_BIAS, HAS_MASK, BLOCK_N, BLOCK_D, TILE,
                          PRECISION, EMULATE)
    s = _step_of(MASK, s_mb, b_, step, N, HAS_MASK, BLOCK_N)
    w1, w2, w3 = _initial(W1, W2, W3, h, d, d_ok, D)  # (float32 again: the TILE copies may be rounded)
    return w1 + s * g1, w2 + s * g2, w3 + s * g3


@triton.jit
def inner_sums_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, G, COUNTER, WP, KEPT,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step,
    B, H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, KEEP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Partial Ĝ1, Ĝ2, Ĝ3 of one (batch·head, token range) into G: (BH, 3, SPLITS, D, D) float32; the last of a
    batch·head's programs (a ticket in COUNTER) sums them in the ranges' order and writes W' = W + step·Ĝ into WP
    (BH, 3, D, D) float32, what the read-out reads, and with ``KEEP`` into KEPT too, in its dtype (what the backward
    reads: :func:`_updated_from_partials`)."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    mean, rstd = _statistics(STATS, B, H, D, b_, h, d, d_ok, K_CONV)
    g1, g2, g3 = key_sums(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, N, D,
                          P, ROWS, COLS, b_, h, d, d_ok, begin, end, K_CONV, K_BIAS, HAS_MASK, BLOCK_N, BLOCK_D,
                          TILE, PRECISION, EMULATE)
    _put_partials(G, bh, split, SPLITS, g1, g2, g3, d, d_ok, D)
    if _last_program(COUNTER, bh, SPLITS):
        _updated_from_partials(G, WP, KEPT, W1, W2, W3, MASK, s_mb, step, bh, b_, h, N, SPLITS, D, HAS_MASK, KEEP,
                               BLOCK_N, BLOCK_D)
        _ticket_back(COUNTER, bh)


@triton.jit
def _updated_from_partials(G, WP, KEPT, W1, W2, W3, MASK, s_mb, step, bh, b_, h, N, SPLITS, D,
                           HAS_MASK: tl.constexpr, KEEP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """W'_j = W_j + step·Σ_ranges Ĝ_j of one batch·head, summed in the ranges' order (deterministic), one matrix at a
    time (entry bh·3 + j of WP, and of KEPT with ``KEEP``: the backward's copy, in the dtype its tiles take, rounded
    as they would round it), as flat rows of the d×d entries (:func:`flat_square`)."""
    s = _step_of(MASK, s_mb, b_, step, N, HAS_MASK, BLOCK_N)
    at, ok = flat_square(D, BLOCK_D)
    for j in tl.static_range(3):
        W = W1 if j == 0 else (W2 if j == 1 else W3)
        total = _summed(G, (bh * 3 + j) * SPLITS, SPLITS, 0, D * D, at, ok)
        initial = tl.load(W + h * D * D + at, mask=ok, other=0.0).to(tl.float32)
        updated = initial + s * total
        tl.store(WP + (bh * 3 + j) * D * D + at, updated, mask=ok)
        if KEEP:
            tl.store(KEPT + (bh * 3 + j) * D * D + at, updated.to(KEPT.dtype.element_ty), mask=ok)


@triton.jit
def flat_square(D, BLOCK_D: tl.constexpr):
    """(offsets, valid) of a d×d matrix's entries as one flat range: the epilogues' index, apart from the main loop's
    2-D one (sharing it, the compiler kept its offsets and masks live through the loop: more registers, spills)."""
    flat = tl.arange(0, BLOCK_D * BLOCK_D)
    row, col = flat // BLOCK_D, flat % BLOCK_D
    return row * D + col, (row < D) & (col < D)


@triton.jit
def _read_out(q_base, o_base, s_qn, s_on, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, begin, end, d, d_ok, w1,
              w2, w3, CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """o = (silu(qW1') ⊙ qW2') W3' of the queries begin..end (W' as TILE operands), stored at ``o_base``."""
    for start in range(begin, end, BLOCK_N):
        tok, _, tile = _chunk(start, end, MASK, d_ok, BLOCK_N, False)
        q = _queries(q_base, tok, tile, d, d_ok, s_qn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, CONV, HAS_BIAS,
                     HAS_MASK, BLOCK_N, BLOCK_D)
        _, b, _, act, _ = _swiglu_parts(q, w1, w2, TILE, PRECISION, EMULATE)
        o = _dot((act * b).to(TILE), w3, PRECISION, EMULATE)
        tl.store(o_base + tok[:, None] * s_on + d[None, :], o.to(o_base.dtype.element_ty), mask=tile)


@triton.jit
def swiglu_readout_kernel(
    Q, QW, QB, MASK, W, O,
    s_qb, s_qh, s_qn, s_mb, s_ob, s_oh, s_on,
    H, N, D, tokens_per_split, P, ROWS, COLS,
    CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """o of the queries of one (batch·head, token range) from W' (BH, 3, D, D) float32; ``CONV``: q convolved as it
    loads (:func:`_queries`)."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _three(W, bh * 3, d, d_ok, D)
    _read_out(Q + b_ * s_qb + h * s_qh, O + b_ * s_ob + h * s_oh, s_qn, s_on, QW, QB, MASK, s_mb, b_, h, N, D, P,
              ROWS, COLS, begin, end, d, d_ok, w1.to(TILE), w2.to(TILE), w3.to(TILE), CONV, HAS_BIAS, HAS_MASK,
              BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)


@triton.jit
def key_norm(K, MASK, STATS, s_kb, s_kh, s_kn, s_mb, eps, B, H, N, D, b_, h, d, d_ok, K_CONV: tl.constexpr,
             HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The keys' (μ, r) of batch b_, head h with ``K_CONV`` (zeros without), formed from its keys in this program
    (:func:`..grid.kernels.key_statistics`) and stored into STATS (2, B, H, D) float32 for backward: no pass of its
    own over the keys."""
    if K_CONV:
        mean, rstd = key_statistics(K + b_ * s_kb + h * s_kh, s_kn, MASK, s_mb, b_, N, d, d_ok, eps, HAS_MASK,
                                    BLOCK_N, BLOCK_D)
        at = STATS + (b_ * H + h) * D + d
        tl.store(at, mean, mask=d_ok)
        tl.store(at + B * H * D, rstd, mask=d_ok)
    else:
        mean, rstd = tl.zeros_like(d).to(tl.float32), tl.zeros_like(d).to(tl.float32)
    return mean, rstd


@triton.jit
def ttt_fwd_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, Q, QW, QB, O,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_qb, s_qh, s_qn, s_ob, s_oh, s_on, eps,
    B, H, N, D, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, CONV: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """The step of one (batch, head) in one program: the keys' statistics (``K_CONV``: :func:`key_norm`, written
    out), W' from all its keys (:func:`updated_weights`), kept in registers, then every query's o (grid: (B·H,))."""
    bh, _, b_, h, d, d_ok, _, _ = _program(H, N, D, N, BLOCK_D)
    mean, rstd = key_norm(K, MASK, STATS, s_kb, s_kh, s_kn, s_mb, eps, B, H, N, D, b_, h, d, d_ok, K_CONV, HAS_MASK,
                          BLOCK_N, BLOCK_D)
    w1, w2, w3 = updated_weights(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                                 s_mb, step, N, D, P, ROWS, COLS, b_, h, d, d_ok, K_CONV, K_BIAS, HAS_MASK,
                                 BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    _read_out(Q + b_ * s_qb + h * s_qh, O + b_ * s_ob + h * s_oh, s_qn, s_on, QW, QB, MASK, s_mb, b_, h, N, D, P,
              ROWS, COLS, 0, N, d, d_ok, w1.to(TILE), w2.to(TILE), w3.to(TILE), CONV, HAS_BIAS, HAS_MASK, BLOCK_N,
              BLOCK_D, TILE, PRECISION, EMULATE)
