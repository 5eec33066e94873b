"""Triton kernels of TTT's closed-form step (attention/ttt.py): the inner gradients, the read-out of the updated
model, and their backward passes.

Per (batch, head), with k the normalised and convolved keys, a = kW1, b = kW2, act = silu(a), u = vW3ᵀ:

    Ĝ1 = Σ_j k_jᵀ (u ⊙ b ⊙ silu'(a))_j,   Ĝ2 = Σ_j k_jᵀ (u ⊙ act)_j,   Ĝ3 = Σ_j (act ⊙ b)_jᵀ v_j

are the inner loss's gradients before its −s/N factor (the d×d sums are scaled, so nothing N-sized is scaled and
float16 does not underflow), W' = W − lr·(−s/N)·Ĝ (in the sums kernel's epilogue when one program sums a head's
tokens, else by the caller from the partial sums), and every query reads

    o_i = (silu(q_i W1') ⊙ (q_i W2')) W3'.

Each program owns one (batch·head, token range) and walks it in chunks of BLOCK_N tokens; the token-sized
intermediates (a, b, silu, its derivative, u) live in float32 registers only, the dots run as the linear-attention
kernels' (ops/linear/kernel_parts.py: TILE operands, float32 accumulators), and partial d×d sums are written per program
and summed by the caller. Masked keys load as zero rows of k and v, which add nothing to any sum and get zero
gradients. Backward recomputes a, b and u from k and v, and reads W' (which the op returns for it), so a training
step keeps nothing N-sized beyond q, k and v.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import conv_taps
from ..linear.kernel_parts import _dot, _load_square, _store_square


@triton.jit
def _three(P, first, d, d_ok, D):
    """Matrices first, first + 1, first + 2 of a stack of (D, D) float32 ones ([W1, W2, W3] or their gradients)."""
    return (_load_square(P, first, d, d_ok, D), _load_square(P, first + 1, d, d_ok, D),
            _load_square(P, first + 2, d, d_ok, D))


@triton.jit
def _three_both_ways(P, first, d, d_ok, D, TILE: tl.constexpr):
    """:func:`_three` as TILE operands, each also transposed (backward multiplies by both)."""
    x1, x2, x3 = _three(P, first, d, d_ok, D)
    return (x1.to(TILE), x2.to(TILE), x3.to(TILE),
            tl.trans(x1).to(TILE), tl.trans(x2).to(TILE), tl.trans(x3).to(TILE))


@triton.jit
def _initial(W, h, H, d, d_ok, D):
    """W1, W2, W3 of head h from the (3, H, D, D) float32 fast weights (each weight's heads together: their
    gradients are then three contiguous tensors, which autograd takes as the parameters' own, no copy)."""
    return (_load_square(W, h, d, d_ok, D), _load_square(W, H + h, d, d_ok, D),
            _load_square(W, 2 * H + h, d, d_ok, D))


@triton.jit
def _initial_both_ways(W, h, H, d, d_ok, D, TILE: tl.constexpr):
    """:func:`_initial` as TILE operands, each also transposed (backward multiplies by both)."""
    x1, x2, x3 = _initial(W, h, H, d, d_ok, D)
    return (x1.to(TILE), x2.to(TILE), x3.to(TILE),
            tl.trans(x1).to(TILE), tl.trans(x2).to(TILE), tl.trans(x3).to(TILE))


@triton.jit
def _put_weight_partials(P, bh, split, SPLITS, x1, x2, x3, d, d_ok, D):
    """One program's partial dW1, dW2, dW3 into a (3, BH, SPLITS, D, D) float32 stack: summed over the batch and
    the ranges, (3, H, D, D) as the fast weights' own layout (:func:`_initial`)."""
    first = bh * SPLITS + split
    apart = tl.num_programs(0) * SPLITS
    _store_square(P, first, x1, d, d_ok, D)
    _store_square(P, first + apart, x2, d, d_ok, D)
    _store_square(P, first + 2 * apart, x3, d, d_ok, D)


@triton.jit
def _step_of(STEPS, b_, step, HAS_MASK: tl.constexpr):
    """lr·s/n of batch b_: ``step`` (a float) without a mask, STEPS[b_] ((B,) float32) with one."""
    s = step
    if HAS_MASK:
        s = tl.load(STEPS + b_)
    return s


@triton.jit
def _three_scaled(P, first, s, d, d_ok, D, TILE: tl.constexpr):
    """:func:`_three_both_ways` of s·P (the sums' gradient dĜ = step·dW', scaled here, not by a torch op)."""
    x1, x2, x3 = _three(P, first, d, d_ok, D)
    x1, x2, x3 = x1 * s, x2 * s, x3 * s
    return (x1.to(TILE), x2.to(TILE), x3.to(TILE),
            tl.trans(x1).to(TILE), tl.trans(x2).to(TILE), tl.trans(x3).to(TILE))


@triton.jit
def _put_partials(P, bh, split, SPLITS, x1, x2, x3, d, d_ok, D):
    """One program's three partial sums into a (BH, 3, SPLITS, D, D) float32 stack (layout._total's layout)."""
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
    of q on the grid (QW: (H·D, 9) float32 filters, QB its bias) added as the tile loads: the convolved q never
    crosses memory."""
    q = _rows(q_base, tok, tile, d, s_qn)
    if CONV:
        none = tl.zeros_like(d).to(tl.float32)
        q = tl.where(tile, q + conv_taps(q_base, s_qn, tok, d, d_ok, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS,
                                         none, none, 3, False, HAS_BIAS, HAS_MASK, BLOCK_N, BLOCK_D), 0.0)
    return q


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
def _key_chunk(k_base, v_base, mask_row, start, end, d, d_ok, s_kn, s_vn, w1, w2, w3_t, BLOCK_N: tl.constexpr,
               HAS_MASK: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One chunk of keys and values (masked keys as zero rows) and what the inner gradients make of them:
    (token index, tile, k, v in the tile dtype, a, b, σ(a), silu(a), silu'(a), u = vW3ᵀ)."""
    tok, _, tile = _chunk(start, end, mask_row, d_ok, BLOCK_N, HAS_MASK)
    k = _rows(k_base, tok, tile, d, s_kn)
    v = _rows(v_base, tok, tile, d, s_vn).to(TILE)
    a, b, sig, act, dsilu = _swiglu_parts(k, w1, w2, TILE, PRECISION, EMULATE)
    return tok, tile, k.to(TILE), v, a, b, sig, act, dsilu, _dot(v, w3_t, PRECISION, EMULATE)


@triton.jit
def inner_sums_kernel(
    K, V, MASK, W, G, STEPS,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step,
    H, N, D, SPLITS, tokens_per_split,
    UPDATE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Partial Ĝ1, Ĝ2, Ĝ3 of one (batch·head, token range). W: (3, H, D, D) float32, G: (BH, 3, SPLITS, D, D).
    ``UPDATE`` (one range: SPLITS 1): W' = W + step·Ĝ instead (:func:`_step_of`), the update in this kernel's
    epilogue, not a torch op that reads Ĝ and W and writes W' again."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _initial(W, h, H, d, d_ok, D)
    w1, w2, w3_t = w1.to(TILE), w2.to(TILE), tl.trans(w3).to(TILE)
    g1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    g2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    g3 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    k_base, v_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh
    for start in range(begin, end, BLOCK_N):
        _, _, k, v, _, b, _, act, dsilu, u = _key_chunk(k_base, v_base, MASK + b_ * s_mb, start, end, d, d_ok, s_kn,
                                                        s_vn, w1, w2, w3_t, BLOCK_N, HAS_MASK, TILE, PRECISION,
                                                        EMULATE)
        kt = tl.trans(k)
        g1 += _dot(kt, (u * b * dsilu).to(TILE), PRECISION, EMULATE)
        g2 += _dot(kt, (u * act).to(TILE), PRECISION, EMULATE)
        g3 += _dot(tl.trans((act * b).to(TILE)), v, PRECISION, EMULATE)
    if UPDATE:
        s = _step_of(STEPS, b_, step, HAS_MASK)
        u1, u2, u3 = _initial(W, h, H, d, d_ok, D)  # (float32 again: the TILE copies may be rounded)
        g1, g2, g3 = u1 + s * g1, u2 + s * g2, u3 + s * g3
    _put_partials(G, bh, split, SPLITS, g1, g2, g3, d, d_ok, D)


@triton.jit
def swiglu_readout_kernel(
    Q, QW, QB, MASK, W, O,
    s_qb, s_qh, s_qn, s_mb, s_ob, s_oh, s_on,
    H, N, D, tokens_per_split, P, ROWS, COLS,
    CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """o = (silu(qW1') ⊙ qW2') W3' for the queries of one (batch·head, token range); W: (BH, 3, D, D) float32;
    ``CONV``: q convolved as it loads (:func:`_queries`)."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _three(W, bh * 3, d, d_ok, D)
    w1, w2, w3 = w1.to(TILE), w2.to(TILE), w3.to(TILE)
    q_base, o_base = Q + b_ * s_qb + h * s_qh, O + b_ * s_ob + h * s_oh
    for start in range(begin, end, BLOCK_N):
        tok, _, tile = _chunk(start, end, Q, d_ok, BLOCK_N, False)
        q = _queries(q_base, tok, tile, d, d_ok, s_qn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, CONV, HAS_BIAS,
                     HAS_MASK, BLOCK_N, BLOCK_D)
        _, b, _, act, _ = _swiglu_parts(q, w1, w2, TILE, PRECISION, EMULATE)
        o = _dot((act * b).to(TILE), w3, PRECISION, EMULATE)
        tl.store(o_base + tok[:, None] * s_on + d[None, :], o.to(O.dtype.element_ty), mask=tile)


@triton.jit
def swiglu_readout_bwd_kernel(
    Q, QW, QB, MASK, W, DO, DQ, DW,
    s_qb, s_qh, s_qn, s_mb, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, N, D, SPLITS, tokens_per_split, P, ROWS, COLS,
    CONV: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dq of each query and partial dW1', dW2', dW3' of the range (DW: (BH, 3, SPLITS, D, D)):
    dh = do W3'ᵀ, da = dh ⊙ b ⊙ silu'(a), db = dh ⊙ silu(a), dq = da W1'ᵀ + db W2'ᵀ, dW1' = Σ qᵀda,
    dW2' = Σ qᵀdb, dW3' = Σ hᵀdo; with ``CONV`` q is convolved as it loads and dq is the convolved q's."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    # (w3 is unused but named: `_` is reassigned in the loop with another shape, and Triton's compiler, unlike its
    # interpreter, refuses a loop-carried variable whose type changes)
    w1, w2, w3, w1_t, w2_t, w3_t = _three_both_ways(W, bh * 3, d, d_ok, D, TILE)
    dw1 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    q_base, g_base, dq_base = Q + b_ * s_qb + h * s_qh, DO + b_ * s_gb + h * s_gh, DQ + b_ * s_dqb + h * s_dqh
    for start in range(begin, end, BLOCK_N):
        tok, _, tile = _chunk(start, end, Q, d_ok, BLOCK_N, False)
        q = _queries(q_base, tok, tile, d, d_ok, s_qn, QW, QB, MASK, s_mb, b_, h, N, D, P, ROWS, COLS, CONV, HAS_BIAS,
                     HAS_MASK, BLOCK_N, BLOCK_D)
        g = _rows(g_base, tok, tile, d, s_gn).to(TILE)
        _, b, _, act, dsilu = _swiglu_parts(q, w1, w2, TILE, PRECISION, EMULATE)
        dh = _dot(g, w3_t, PRECISION, EMULATE)
        da = (dh * b * dsilu).to(TILE)
        db = (dh * act).to(TILE)
        dq = _dot(da, w1_t, PRECISION, EMULATE) + _dot(db, w2_t, PRECISION, EMULATE)
        tl.store(dq_base + tok[:, None] * s_dqn + d[None, :], dq.to(DQ.dtype.element_ty), mask=tile)
        qt = tl.trans(q.to(TILE))
        dw1 += _dot(qt, da, PRECISION, EMULATE)
        dw2 += _dot(qt, db, PRECISION, EMULATE)
        dw3 += _dot(tl.trans((act * b).to(TILE)), g, PRECISION, EMULATE)
    _put_partials(DW, bh, split, SPLITS, dw1, dw2, dw3, d, d_ok, D)


@triton.jit
def _through_sums(kt, vt, dg1, dg2, dg3_t, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """The inner gradients' gradient at each token: at da (through Ĝ1 = kᵀda), db (Ĝ2 = kᵀdb) and h (Ĝ3 = hᵀv)."""
    return (_dot(kt, dg1, PRECISION, EMULATE), _dot(kt, dg2, PRECISION, EMULATE),
            _dot(vt, dg3_t, PRECISION, EMULATE))


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
def inner_sums_bwd_kernel(
    K, V, MASK, W, DG, STEPS, DK, DV, DW,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    H, N, D, SPLITS, tokens_per_split,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dk, dv of one (batch·head, token range) and its partial dW1, dW2, dW3 (DW: (3, BH, SPLITS, D, D); the first
    range's part also holds dW', so that the ranges' and the batch's sum is dW) from dW' (DG: (BH, 3, D, D)) and
    dĜ = step·dW' (:func:`_step_of`), through da = u⊙b⊙silu'(a), db = u⊙act, h = act⊙b, u = vW3ᵀ, a = kW1, b = kW2. It
    holds twelve d×d operands (W1–W3, dĜ1–dĜ3, both ways round): where they do not fit a GPU's shared memory,
    :func:`inner_sums_bwd_keys_kernel` and :func:`inner_sums_bwd_values_kernel` split it in two."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3, w1_t, w2_t, w3_t = _initial_both_ways(W, h, H, d, d_ok, D, TILE)
    dg1, dg2, dg3, dg1_t, dg2_t, dg3_t = _three_scaled(DG, bh * 3, _step_of(STEPS, b_, step, HAS_MASK), d, d_ok,
                                                       D, TILE)
    dw1, dw2, dw3 = _three(DG, bh * 3, d, d_ok, D)  # dW = dW' + the chain's: dW' in the first range's part
    leading = tl.where(split == 0, 1.0, 0.0)
    dw1, dw2, dw3 = dw1 * leading, dw2 * leading, dw3 * leading
    k_base, v_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh
    dk_base, dv_base = DK + b_ * s_dkb + h * s_dkh, DV + b_ * s_dvb + h * s_dvh
    for start in range(begin, end, BLOCK_N):
        tok, tile, kt, vt, a, b, sig, act, dsilu, u = _key_chunk(k_base, v_base, MASK + b_ * s_mb, start, end, d,
                                                                 d_ok, s_kn, s_vn, w1, w2, w3_t, BLOCK_N, HAS_MASK,
                                                                 TILE, PRECISION, EMULATE)
        d_da, d_db, d_h = _through_sums(kt, vt, dg1, dg2, dg3_t, PRECISION, EMULATE)
        d_a, d_b = _at_a_and_b(d_da, d_db, d_h, a, b, sig, act, dsilu, u, TILE)
        du = (d_da * b * dsilu + d_db * act).to(TILE)
        dk = _key_gradient(u, b, act, dsilu, d_a, d_b, dg1_t, dg2_t, w1_t, w2_t, TILE, PRECISION, EMULATE)
        dv = _dot((act * b).to(TILE), dg3, PRECISION, EMULATE) + _dot(du, w3, PRECISION, EMULATE)
        dw1 += _dot(tl.trans(kt), d_a, PRECISION, EMULATE)
        dw2 += _dot(tl.trans(kt), d_b, PRECISION, EMULATE)
        dw3 += _dot(tl.trans(du), vt, PRECISION, EMULATE)
        _store_key_rows(dk_base, tok, tile, end, d, d_ok, s_dkn, dk)
        _store_key_rows(dv_base, tok, tile, end, d, d_ok, s_dvn, dv)
    _put_weight_partials(DW, bh, split, SPLITS, dw1, dw2, dw3, d, d_ok, D)


@triton.jit
def inner_sums_bwd_keys_kernel(
    K, V, MASK, W, DG, STEPS, DK, DW,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dkb, s_dkh, s_dkn,
    H, N, D, SPLITS, tokens_per_split,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """:func:`inner_sums_bwd_kernel`'s dk and partial dW1, dW2 (DW's first two of three), on ten d×d operands."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3, w1_t, w2_t, w3_t = _initial_both_ways(W, h, H, d, d_ok, D, TILE)  # (w3 unused: not loaded)
    dg1, dg2, dg3, dg1_t, dg2_t, dg3_t = _three_scaled(DG, bh * 3, _step_of(STEPS, b_, step, HAS_MASK), d, d_ok,
                                                       D, TILE)  # (dg3 unused)
    dw1, dw2, dw3 = _three(DG, bh * 3, d, d_ok, D)  # (dw3 unused) dW' in the first range's part, as the one kernel's
    leading = tl.where(split == 0, 1.0, 0.0)
    dw1, dw2 = dw1 * leading, dw2 * leading
    k_base, v_base, dk_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh, DK + b_ * s_dkb + h * s_dkh
    for start in range(begin, end, BLOCK_N):
        tok, tile, kt, vt, a, b, sig, act, dsilu, u = _key_chunk(k_base, v_base, MASK + b_ * s_mb, start, end, d,
                                                                 d_ok, s_kn, s_vn, w1, w2, w3_t, BLOCK_N, HAS_MASK,
                                                                 TILE, PRECISION, EMULATE)
        d_da, d_db, d_h = _through_sums(kt, vt, dg1, dg2, dg3_t, PRECISION, EMULATE)
        d_a, d_b = _at_a_and_b(d_da, d_db, d_h, a, b, sig, act, dsilu, u, TILE)
        dk = _key_gradient(u, b, act, dsilu, d_a, d_b, dg1_t, dg2_t, w1_t, w2_t, TILE, PRECISION, EMULATE)
        dw1 += _dot(tl.trans(kt), d_a, PRECISION, EMULATE)
        dw2 += _dot(tl.trans(kt), d_b, PRECISION, EMULATE)
        _store_key_rows(dk_base, tok, tile, end, d, d_ok, s_dkn, dk)
    first, apart = bh * SPLITS + split, tl.num_programs(0) * SPLITS  # (_put_weight_partials' layout)
    _store_square(DW, first, dw1, d, d_ok, D)
    _store_square(DW, first + apart, dw2, d, d_ok, D)


@triton.jit
def inner_sums_bwd_values_kernel(
    K, V, MASK, W, DG, STEPS, DV, DW,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, step, s_dvb, s_dvh, s_dvn,
    H, N, D, SPLITS, tokens_per_split,
    HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """:func:`inner_sums_bwd_kernel`'s dv and partial dW3 (DW's third of three), on seven d×d operands."""
    bh, split, b_, h, d, d_ok, begin, end = _program(H, N, D, tokens_per_split, BLOCK_D)
    w1, w2, w3 = _initial(W, h, H, d, d_ok, D)
    w1, w2, w3, w3_t = w1.to(TILE), w2.to(TILE), w3.to(TILE), tl.trans(w3).to(TILE)
    s = _step_of(STEPS, b_, step, HAS_MASK)
    dg1, dg2, dg3 = _three(DG, bh * 3, d, d_ok, D)
    dw3 = dg3 * tl.where(split == 0, 1.0, 0.0)  # dW' in the first range's part, as the one kernel's
    dg1, dg2, dg3 = (dg1 * s).to(TILE), (dg2 * s).to(TILE), (dg3 * s).to(TILE)
    k_base, v_base, dv_base = K + b_ * s_kb + h * s_kh, V + b_ * s_vb + h * s_vh, DV + b_ * s_dvb + h * s_dvh
    for start in range(begin, end, BLOCK_N):
        tok, tile, kt, vt, a, b, sig, act, dsilu, u = _key_chunk(k_base, v_base, MASK + b_ * s_mb, start, end, d,
                                                                 d_ok, s_kn, s_vn, w1, w2, w3_t, BLOCK_N, HAS_MASK,
                                                                 TILE, PRECISION, EMULATE)
        du = (_dot(kt, dg1, PRECISION, EMULATE) * b * dsilu + _dot(kt, dg2, PRECISION, EMULATE) * act).to(TILE)
        dv = _dot((act * b).to(TILE), dg3, PRECISION, EMULATE) + _dot(du, w3, PRECISION, EMULATE)
        dw3 += _dot(tl.trans(du), vt, PRECISION, EMULATE)
        _store_key_rows(dv_base, tok, tile, end, d, d_ok, s_dvn, dv)
    _store_square(DW, bh * SPLITS + split + 2 * tl.num_programs(0) * SPLITS, dw3, d, d_ok, D)
