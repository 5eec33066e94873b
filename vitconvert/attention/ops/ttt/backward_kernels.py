"""Triton kernels of the backward of TTT's closed-form step (:mod:`.kernels` holds the forward and the notation).

The read-out's backward gives dq and dW' from q, do and W'; where one program owns a head's tokens,
:func:`ttt_readout_bwd_kernel` first recomputes W' from the keys in registers (the forward's
:func:`.kernels.updated_weights`), so W' is neither kept nor written. The sums' backward then gives dk, dv and
the chain's dW from k, v, W and dĜ = step·dW', recomputing the forward's token-sized values (a, b, silu, u) from
k and v: a training step keeps nothing N-sized beyond q, k and v. With ``K_CONV`` (the op took the raw keys) k is
normalised and convolved as it loads and the sums' backward gives the convolved keys' gradient, which
:func:`ttt_bwd_kernel` takes through the conv and the norm itself and the split kernels leave to the caller (ops/grid's
backward kernel); with ``CONV`` q is convolved as it loads, and its gradient likewise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import _statistics, residual_conv_backward
from ..linear.kernel_parts import _dot, _store_square
from ..linear.tickets import _last_program, _summed, _ticket_back
from .kernels import (
    _chunk,
    _initial,
    _key_chunk,
    _program,
    _put_partials,
    _queries,
    _rows,
    _step_of,
    _swiglu_parts,
    _three,
    flat_square,
    updated_weights,
)


@triton.jit
def _read_out_backward(q_base, g_base, dq_base, s_qn, s_gn, s_dqn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS,
                       begin, end, d, d_ok, w1, w2, w3, CONV: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                       PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """dq of the queries begin..end (stored) and their dW1', dW2', dW3' (returned) from W' (float32):
    dh = do W3'ᵀ, da = dh ⊙ b ⊙ silu'(a), db = dh ⊙ silu(a), dq = da W1'ᵀ + db W2'ᵀ, dW1' = Σ qᵀda,
    dW2' = Σ qᵀdb, dW3' = Σ hᵀdo."""
    w1_t, w2_t, w3_t = tl.trans(w1).to(TILE), tl.trans(w2).to(TILE), tl.trans(w3).to(TILE)
    w1, w2 = w1.to(TILE), w2.to(TILE)
    dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    for start in range(begin, end, BLOCK_N):
        tok, _, tile = _chunk(start, end, MASK, d_ok, BLOCK_N, False)
        q = _queries(q_base, tok, tile, d, d_ok, s_qn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, CONV, HAS_BIAS,
                     HAS_MASK, BLOCK_N, BLOCK_D)
        g = _rows(g_base, tok, tile, d, s_gn).to(TILE)
        _, b, _, act, dsilu = _swiglu_parts(q, w1, w2, TILE, PRECISION, EMULATE)
        dh = _dot(g, w3_t, PRECISION, EMULATE)
        da = (dh * b * dsilu).to(TILE)
        db = (dh * act).to(TILE)
        dq = _dot(da, w1_t, PRECISION, EMULATE) + _dot(db, w2_t, PRECISION, EMULATE)
        tl.store(dq_base + tok[:, None] * s_dqn + d[None, :], dq.to(dq_base.dtype.element_ty), mask=tile)
        qt = tl.trans(q.to(TILE))
        dw1 += _dot(qt, da, PRECISION, EMULATE)
        dw2 += _dot(qt, db, PRECISION, EMULATE)
        dw3 += _dot(tl.trans((act * b).to(TILE)), g, PRECISION, EMULATE)
    return dw1, dw2, dw3


@triton.jit
def swiglu_readout_bwd_kernel(
    Q, QW, QB, MASK, W, DO, DQ, DW, COUNTER, DWT,
    s_qb, s_qh, s_qn, s_mb, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dq of the queries of one (batch·head, token range) and its partial dW1', dW2', dW3' (DW: (BH, 3, SPLITS, D,
    D)) from W' (BH, 3, D, D) float32 (:func:`_read_out_backward`); the last of a batch·head's programs (a ticket in
    COUNTER) sums the ranges' partials in their order into DWT (BH, 3, D, D), the dW' the sums' backward reads."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _three(W, bh * 3, d, d_ok, D)
    dw1, dw2, dw3 = _read_out_backward(Q + b_ * s_qb + h * s_qh, DO + b_ * s_gb + h * s_gh, DQ + b_ * s_dqb + h * s_dqh,
                                       s_qn, s_gn, s_dqn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, begin, end,
                                       d, d_ok, w1, w2, w3, CONV, HAS_BIAS, HAS_MASK, BLOCK_N, BLOCK_D, TILE,
                                       PRECISION, EMULATE)
    _put_partials(DW, bh, split, SPLITS, dw1, dw2, dw3, d, d_ok, D)
    if _last_program(COUNTER, bh, SPLITS):
        for j in tl.static_range(3):
            _summed_square(DW, DWT, (bh * 3 + j) * SPLITS, SPLITS, bh * 3 + j, D, BLOCK_D)
        _ticket_back(COUNTER, bh)


@triton.jit
def _summed_square(P, OUT, first, count, which, D, BLOCK_D: tl.constexpr):
    """Entry ``which`` of a (…, D, D) float32 OUT: the sum of P's d×d entries ``first``..``first + count``, in their
    order (deterministic), by flat rows (:func:`.kernels.flat_square`)."""
    at, ok = flat_square(D, BLOCK_D)
    tl.store(OUT + which * D * D + at, _summed(P, first, count, 0, D * D, at, ok), mask=ok)


@triton.jit
def ttt_readout_bwd_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, Q, QW, QB, DO, DQ, DW,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_qb, s_qh, s_qn, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    B, H, N, D, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, CONV: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """:func:`swiglu_readout_bwd_kernel` of one (batch, head) in one program, W' recomputed from its keys first
    (grid: (B·H,); DW: (BH, 3, 1, D, D))."""
    bh, _, b_, h, d, d_ok, _, _ = _program(H, N, D, N, BLOCK_D)
    mean, rstd = _statistics(STATS, B, H, D, b_, h, d, d_ok, K_CONV)
    w1, w2, w3 = updated_weights(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                                 s_mb, step, N, D, P, ROWS, COLS, b_, h, d, d_ok, K_CONV, K_BIAS, HAS_MASK,
                                 BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    dw1, dw2, dw3 = _read_out_backward(Q + b_ * s_qb + h * s_qh, DO + b_ * s_gb + h * s_gh, DQ + b_ * s_dqb + h * s_dqh,
                                       s_qn, s_gn, s_dqn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, 0, N, d,
                                       d_ok, w1, w2, w3, CONV, HAS_BIAS, HAS_MASK, BLOCK_N, BLOCK_D, TILE, PRECISION,
                                       EMULATE)
    _put_partials(DW, bh, 0, 1, dw1, dw2, dw3, d, d_ok, D)


@triton.jit
def _at_a_and_b(d_da, d_db, d_h, a, b, sig, act, dsilu, u, TILE: tl.constexpr):
    """The gradients at a = kW1 and b = kW2 (silu''(a) = σ(1 − σ)(2 + a(1 − 2σ))), as TILE operands."""
    d_b = d_da * u * dsilu + d_h * act
    d_act = d_db * u + d_h * b
    d_a = d_act * dsilu + d_da * u * b * (sig * (1.0 - sig) * (2.0 + a * (1.0 - 2.0 * sig)))
    return d_a.to(TILE), d_b.to(TILE)


@triton.jit
def _key_gradient(u, b, act, dsilu, d_a, d_b, dg1_t, dg2_t, w1_t, w2_t, TILE: tl.constexpr, PRECISION: tl.constexpr,
                  EMULATE: tl.constexpr):
    """dk: through da = u⊙b⊙silu'(a) and db = u⊙act into Ĝ1 = kᵀda, Ĝ2 = kᵀdb, and through a = kW1, b = kW2."""
    return (_dot((u * b * dsilu).to(TILE), dg1_t, PRECISION, EMULATE) + _dot((u * act).to(TILE), dg2_t, PRECISION,
                                                                             EMULATE)
            + _dot(d_a, w1_t, PRECISION, EMULATE) + _dot(d_b, w2_t, PRECISION, EMULATE))


@triton.jit
def _store_key_rows(base, tok, tile, end, d, d_ok, stride, x):
    """A chunk's gradient rows; masked keys get a zero gradient, written."""
    store = (tok < end)[:, None] & d_ok[None, :]
    tl.store(base + tok[:, None] * stride + d[None, :], tl.where(tile, x, 0.0).to(base.dtype.element_ty), mask=store)


@triton.jit
def _sums_backward_start(W1, W2, W3, DG, MASK, s_mb, STATS, step, B, H, N, D, tokens_per_split, K_CONV: tl.constexpr,
                         HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """What the sums' backward kernels share: their program (:func:`.kernels._program`), W1, W2, W3, dĜ = step·dW'
    (DG: dW', (BH, 3, D, D)), dW' in the first range's part of dW, zero in the others (the ranges' and the batch's
    sum of the parts is then dW = dW' + the chain's), all float32, and the keys' statistics (μ, r)."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _initial(W1, W2, W3, h, d, d_ok, D)
    du1, du2, du3 = _three(DG, bh * 3, d, d_ok, D)
    s = _step_of(MASK, s_mb, b_, step, N, HAS_MASK, BLOCK_N)
    leading = tl.where(split == 0, 1.0, 0.0)
    mean, rstd = _statistics(STATS, B, H, D, b_, h, d, d_ok, K_CONV)
    return (bh, split, b_, h, d, d_ok, begin, end, w1, w2, w3, du1 * s, du2 * s, du3 * s, du1 * leading,
            du2 * leading, du3 * leading, mean, rstd)


@triton.jit
def _through_the_sums(K, V, MASK, KW, KB, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_dkb, s_dkh, s_dkn, s_dvb,
                      s_dvh, s_dvn, b_, h, N, D, P, ROWS, COLS, begin, end, d, d_ok, w1, w2, w3, dg1, dg2, dg3, dw1,
                      dw2, dw3, mean, rstd, K_CONV: tl.constexpr, K_BIAS: tl.constexpr, KEYS: tl.constexpr,
                      VALUES: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """dk (``KEYS``) and dv (``VALUES``) of the keys begin..end (stored), and dW1, dW2 (``KEYS``), dW3 (``VALUES``)
    (returned, added to ``dw1``–``dw3``), from W and dĜ = step·dW' (float32), through da = u⊙b⊙silu'(a),
    db = u⊙act, h = act⊙b, u = vW3ᵀ, a = kW1, b = kW2. Both hold twelve d×d operands (W1–W3, dĜ1–dĜ3, both ways
    round), ``KEYS`` ten, ``VALUES`` seven."""
    w1_t, w2_t, w3_t = tl.trans(w1).to(TILE), tl.trans(w2).to(TILE), tl.trans(w3).to(TILE)
    w1, w2, w3 = w1.to(TILE), w2.to(TILE), w3.to(TILE)
    dg1_t, dg2_t, dg3_t = tl.trans(dg1).to(TILE), tl.trans(dg2).to(TILE), tl.trans(dg3).to(TILE)
    dg1, dg2, dg3 = dg1.to(TILE), dg2.to(TILE), dg3.to(TILE)
    k_base, v_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh
    dk_base, dv_base = DK + b_ * s_dkb + h * s_dkh, DV + b_ * s_dvb + h * s_dvh
    for start in range(begin, end, BLOCK_N):
        tok, tile, kt, vt, a, b, sig, act, dsilu, u = _key_chunk(k_base, v_base, MASK, s_mb, b_, h, start, end, d,
                                                                 d_ok, s_kn, s_vn, w1, w2, w3_t, KW, KB, N, D, P,
                                                                 ROWS, COLS, mean, rstd, K_CONV, K_BIAS, BLOCK_N,
                                                                 BLOCK_D, HAS_MASK, TILE, PRECISION, EMULATE)
        d_da = _dot(kt, dg1, PRECISION, EMULATE)
        d_db = _dot(kt, dg2, PRECISION, EMULATE)
        if KEYS:
            d_h = _dot(vt, dg3_t, PRECISION, EMULATE)
            d_a, d_b = _at_a_and_b(d_da, d_db, d_h, a, b, sig, act, dsilu, u, TILE)
            dk = _key_gradient(u, b, act, dsilu, d_a, d_b, dg1_t, dg2_t, w1_t, w2_t, TILE, PRECISION, EMULATE)
            dw1 += _dot(tl.trans(kt), d_a, PRECISION, EMULATE)
            dw2 += _dot(tl.trans(kt), d_b, PRECISION, EMULATE)
            _store_key_rows(dk_base, tok, tile, end, d, d_ok, s_dkn, dk)
        if VALUES:
            du = (d_da * b * dsilu + d_db * act).to(TILE)
            dv = _dot((act * b).to(TILE), dg3, PRECISION, EMULATE) + _dot(du, w3, PRECISION, EMULATE)
            dw3 += _dot(tl.trans(du), vt, PRECISION, EMULATE)
            _store_key_rows(dv_base, tok, tile, end, d, d_ok, s_dvn, dv)
    return dw1, dw2, dw3


@triton.jit
def _put_weight_partials(P, first, apart, dw1, dw2, dw3, d, d_ok, D, KEYS: tl.constexpr, VALUES: tl.constexpr):
    """One program's partial dW1, dW2 (``KEYS``), dW3 (``VALUES``) into a (3, ``apart``, D, D) float32 stack at
    entry ``first`` of each (summed over its programs, (3, H, D, D))."""
    if KEYS:
        _store_square(P, first, dw1, d, d_ok, D)
        _store_square(P, first + apart, dw2, d, d_ok, D)
    if VALUES:
        _store_square(P, first + 2 * apart, dw3, d, d_ok, D)


@triton.jit
def _sums_backward(K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT, s_kb, s_kh, s_kn, s_vb,
                   s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, B, H, N, D, SPLITS,
                   tokens_per_split, P, ROWS, COLS, K_CONV: tl.constexpr, K_BIAS: tl.constexpr, KEYS: tl.constexpr,
                   VALUES: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """:func:`_through_the_sums` of one (batch·head, token range) from dW' in memory (:func:`_sums_backward_start`),
    its partial dW into DW (3, H·B·SPLITS, D, D: a head's images and ranges side by side); the last of a head's
    B·SPLITS programs (a ticket in COUNTER) sums them in that order into DWT (3, H, D, D), the gradient of W."""
    (bh, split, b_, h, d, d_ok, begin, end, w1, w2, w3, dg1, dg2, dg3, dw1, dw2, dw3, mean,
     rstd) = _sums_backward_start(W1, W2, W3, DG, MASK, s_mb, STATS, step, B, H, N, D, tokens_per_split, K_CONV,
                                  HAS_MASK, BLOCK_N, BLOCK_D)
    dw1, dw2, dw3 = _through_the_sums(K, V, MASK, KW, KB, DK, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_dkb,
                                      s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, b_, h, N, D, P, ROWS, COLS, begin, end, d,
                                      d_ok, w1, w2, w3, dg1, dg2, dg3, dw1, dw2, dw3, mean, rstd, K_CONV, K_BIAS, KEYS,
                                      VALUES, HAS_MASK, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    apart, per_head = B * H * SPLITS, B * SPLITS
    _put_weight_partials(DW, h * per_head + b_ * SPLITS + split, apart, dw1, dw2, dw3, d, d_ok, D, KEYS, VALUES)
    if _last_program(COUNTER, h, per_head):
        if KEYS:
            _summed_square(DW, DWT, h * per_head, per_head, h, D, BLOCK_D)
            _summed_square(DW, DWT, apart + h * per_head, per_head, H + h, D, BLOCK_D)
        if VALUES:
            _summed_square(DW, DWT, 2 * apart + h * per_head, per_head, 2 * H + h, D, BLOCK_D)
        _ticket_back(COUNTER, h)


@triton.jit
def inner_sums_bwd_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    B, H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dk, dv and the partial dW of one (batch·head, token range) (:func:`_sums_backward`); where its twelve d×d
    operands do not fit a GPU's shared memory, :func:`inner_sums_bwd_keys_kernel` and
    :func:`inner_sums_bwd_values_kernel` take its place."""
    _sums_backward(K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT, s_kb, s_kh, s_kn, s_vb,
                   s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, B, H, N, D, SPLITS,
                   tokens_per_split, P, ROWS, COLS, K_CONV, K_BIAS, True, True, HAS_MASK, BLOCK_N, BLOCK_D, TILE,
                   PRECISION, EMULATE)


@triton.jit
def inner_sums_bwd_keys_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    B, H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """:func:`inner_sums_bwd_kernel`'s dk and partial dW1, dW2, on ten d×d operands (DV unread)."""
    _sums_backward(K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT, s_kb, s_kh, s_kn, s_vb,
                   s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, B, H, N, D, SPLITS,
                   tokens_per_split, P, ROWS, COLS, K_CONV, K_BIAS, True, False, HAS_MASK, BLOCK_N, BLOCK_D, TILE,
                   PRECISION, EMULATE)


@triton.jit
def inner_sums_bwd_values_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    B, H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """:func:`inner_sums_bwd_kernel`'s dv and partial dW3, on seven d×d operands (DK unread)."""
    _sums_backward(K, V, MASK, W1, W2, W3, KW, KB, STATS, DG, DK, DV, DW, COUNTER, DWT, s_kb, s_kh, s_kn, s_vb,
                   s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, B, H, N, D, SPLITS,
                   tokens_per_split, P, ROWS, COLS, K_CONV, K_BIAS, False, True, HAS_MASK, BLOCK_N, BLOCK_D, TILE,
                   PRECISION, EMULATE)


@triton.jit
def ttt_bwd_kernel(
    K, V, MASK, W1, W2, W3, KW, KB, STATS, Q, QW, QB, DO, DQ, DK, DV, DW, S, DQW, DQB, DKW, DKB, PART, COUNTER,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_qb, s_qh, s_qn, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, s_sb, s_sh, s_sn, s_pb,
    B, H, N, D, P, ROWS, COLS,
    K_CONV: tl.constexpr, K_BIAS: tl.constexpr, CONV: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """The whole backward of one (batch, head) in one program (grid: (B·H,)): W' recomputed from the keys, the
    read-out's backward (dq, and dW' kept in registers), then the sums' (dk, dv, and dW = dW' + the chain's into DW,
    (3, H, D, D)): neither W' nor dW' crosses memory, and the fast weights are read once. With ``CONV`` and
    ``K_CONV`` the convs' backward too (:func:`_through_the_conv`), last: the convolved q's gradient waits in dk's
    rows, the convolved k's in S (a q-sized scratch), and dq, dk and the filters' gradients of this (batch, head)
    (DQW, DKW: (H·D, 9), DQB, DKB: (H·D,) the biases', in the filters' dtype) come from them in this program. With
    one image W's and the filters' gradients are written where they belong; with more, each image's into its row of
    PART (:func:`_image_parts`) and the last of a head's programs sums them over the batch (:func:`_batch_summed`)."""
    bh, _, b_, h, d, d_ok, _, _ = _program(H, N, D, N, BLOCK_D)
    mean, rstd = _statistics(STATS, B, H, D, b_, h, d, d_ok, K_CONV)
    u1, u2, u3 = updated_weights(K, V, MASK, W1, W2, W3, KW, KB, mean, rstd, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                                 s_mb, step, N, D, P, ROWS, COLS, b_, h, d, d_ok, K_CONV, K_BIAS, HAS_MASK,
                                 BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    q_base, s_at = Q + b_ * s_qb + h * s_qh, S + b_ * s_sb + h * s_sh
    dq_base, dk_base = DQ + b_ * s_dqb + h * s_dqh, DK + b_ * s_dkb + h * s_dkh
    if CONV and K_CONV:  # (the convolved q's gradient waits in dk's rows, the convolved k's in S)
        q_out, s_q_out = dk_base, s_dkn
    elif CONV:
        q_out, s_q_out = s_at, s_sn
    else:
        q_out, s_q_out = dq_base, s_dqn
    du1, du2, du3 = _read_out_backward(q_base, DO + b_ * s_gb + h * s_gh, q_out, s_qn, s_gn, s_q_out, QW, QB, MASK,
                                       s_mb, b_, h, N, D, P, ROWS, COLS, 0, N, d, d_ok, u1, u2, u3, CONV, HAS_BIAS,
                                       HAS_MASK, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    s = _step_of(MASK, s_mb, b_, step, N, HAS_MASK, BLOCK_N)
    w1, w2, w3 = _initial(W1, W2, W3, h, d, d_ok, D)
    if K_CONV:
        KT, s_tb, s_th, s_tn = S, s_sb, s_sh, s_sn
    else:
        KT, s_tb, s_th, s_tn = DK, s_dkb, s_dkh, s_dkn
    dw1, dw2, dw3 = _through_the_sums(K, V, MASK, KW, KB, KT, DV, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_tb,
                                      s_th, s_tn, s_dvb, s_dvh, s_dvn, b_, h, N, D, P, ROWS, COLS, 0, N, d, d_ok, w1,
                                      w2, w3, du1 * s, du2 * s, du3 * s, du1, du2, du3, mean, rstd, K_CONV, K_BIAS,
                                      True, True, HAS_MASK, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    dw_at, qw_at, qb_at, kw_at, kb_at = DW, DQW + h * 9 * D, DQB + h * D, DKW + h * 9 * D, DKB + h * D
    if B > 1:  # (each image's gradients of W and the filters into its row of PART, laid out as the outputs are)
        dw_at, qw_at, qb_at, kw_at, kb_at = _image_row(PART + b_ * s_pb, h, H, D, CONV)
    _put_weight_partials(dw_at, h, H, dw1, dw2, dw3, d, d_ok, D, True, True)
    if CONV:  # (the convs' backward last, when nothing d×d is held: q's, then k's, whose rows q's reads first)
        _through_the_conv(q_base, s_qn, q_out, s_q_out, dq_base, s_dqn, QW, MASK, s_mb, b_, h, N, D, P, ROWS, COLS,
                          mean, rstd, qw_at, qb_at, False, HAS_MASK, BLOCK_N, BLOCK_D)
    if K_CONV:
        _through_the_conv(K + b_ * s_kb + h * s_kh, s_kn, s_at, s_sn, dk_base, s_dkn, KW, MASK, s_mb, b_, h, N, D, P,
                          ROWS, COLS, mean, rstd, kw_at, kb_at, True, HAS_MASK, BLOCK_N, BLOCK_D)
    if B > 1:
        if _last_program(COUNTER, h, B):
            _batch_summed(DW, DQW, DQB, DKW, DKB, PART, s_pb, h, B, H, D, d, d_ok, CONV, K_CONV)
            _ticket_back(COUNTER, h)


def part_width(heads: int, D: int, convs: int) -> int:
    """Floats of an image's row of the backward's PART (:func:`_image_row`): dW (3, H, D, D), then each conv's
    filters and bias (H·D·9 and H·D floats), q's first."""
    return 3 * heads * D * D + 10 * heads * D * convs


@triton.jit
def _image_row(row, h, H, D, CONV: tl.constexpr):
    """Where head h's gradients of W (dW's (3, H, D, D) at the row's start) and of q's and k's filters and biases
    ((H·D, 9), (H·D,) each; k's after q's where ``CONV``) lie in an image's row of PART (:func:`part_width`)."""
    q_filters = row + 3 * H * D * D
    k_filters = q_filters
    if CONV:
        k_filters = q_filters + 10 * H * D
    return (row, q_filters + h * 9 * D, q_filters + 9 * H * D + h * D, k_filters + h * 9 * D,
            k_filters + 9 * H * D + h * D)


@triton.jit
def _batch_summed(DW, DQW, DQB, DKW, DKB, PART, s_pb, h, B, H, D, d, d_ok, CONV: tl.constexpr,
                  K_CONV: tl.constexpr):
    """Head h's gradients of W and the filters by the last of its programs: the images' rows of PART summed in the
    images' order (deterministic; no float atomics), each written once in its gradient's layout."""
    dw_at, qw_at, qb_at, kw_at, kb_at = _image_row(PART, h, H, D, CONV)
    square, square_ok = d[:, None] * D + d[None, :], d_ok[:, None] & d_ok[None, :]
    for j in range(0, 3):
        at = (j * H + h) * D * D
        tl.store(DW + at + square, _summed(dw_at, 0, B, at, s_pb, square, square_ok), mask=square_ok)
    tap = tl.arange(0, 16)
    taps, taps_ok = d[:, None] * 9 + tap[None, :], d_ok[:, None] & (tap < 9)[None, :]
    if CONV:
        tl.store(DQW + h * 9 * D + taps, _summed(qw_at, 0, B, 0, s_pb, taps, taps_ok), mask=taps_ok)
        tl.store(DQB + h * D + d, _summed(qb_at, 0, B, 0, s_pb, d, d_ok), mask=d_ok)
    if K_CONV:
        tl.store(DKW + h * 9 * D + taps, _summed(kw_at, 0, B, 0, s_pb, taps, taps_ok), mask=taps_ok)
        tl.store(DKB + h * D + d, _summed(kb_at, 0, B, 0, s_pb, d, d_ok), mask=d_ok)


@triton.jit
def _through_the_conv(x_at, s_xn, s_at, s_sn, dx_at, s_dn, WEIGHT, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, mean, rstd,
                      DF_AT, DFB_AT, NORM: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """dx and the filter's rows of TTT's residual 3×3 conv (q's, or with ``NORM`` k's through its norm) from the
    convolved tokens' gradient this program has just written to its scratch rows (``s_at``): behind a barrier, as
    each thread reads others' rows, and another after, before the scratch is written again
    (:func:`..grid.kernels.residual_conv_backward`)."""
    tl.debug_barrier()
    residual_conv_backward(x_at, s_xn, s_at, s_sn, dx_at, s_dn, WEIGHT, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, mean,
                           rstd, DF_AT, DFB_AT, 3, NORM, HAS_MASK, BLOCK_N, BLOCK_D)
    tl.debug_barrier()
