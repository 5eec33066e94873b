"""Triton kernels of MHLA's attention in its pairwise (N×N) form, FlashAttention's shape without the softmax.

Each token i belongs to a segment s(i) (MHLA's spatial blocks, then one prefix segment), and W̃ (G×G, float32)
weighs every query-key pair by their segments:

    A_ij = φ(q_i)·φ(k_j) · W̃[s(i), s(j)],    o_i = Σ_j A_ij v_j / (Σ_j A_ij + ε)

which is what the blocked form computes from per-segment d×d states (ops/linear/kernel_parts.py). When blocks are small
(7×7 tokens at 224 px, head dim 64) those states are larger than the tokens they sum: G·d·(d+1) float32 per head
against N·d bf16, written, mixed and read again. Here nothing but q, k, v and o crosses memory; the price is
N²·d dots per head, on tensor cores (:func:`.op.pairwise_is_cheaper` picks the form).

A program owns BLOCK_M tokens (queries in the forward and dq kernels, keys in the dk/dv kernel; the launch grid
is made of them) and walks the other side in chunks of BLOCK_N (which :func:`.dispatch.launch` may halve where a
GPU's shared memory is short: the grid does not depend on it). Backward recomputes the N×N weights tile by tile:
the dq kernel first reads the forward out again (o is not kept), writes each query's 1/(Σ A + ε) and
−(do·o)/(Σ A + ε) for the dk/dv kernel, and sums W̃'s gradient per program through one-hot dots (G ≤ 64).
MHLA's RMSNorm over heads needs every head of a token: the forward kernel reads its query tile's other heads for
q's 1/rms, and each backward kernel's last program of a token tile (a ticket, as the split kernels take) finishes
the norm's backward of its side for every head there, so no pass of q or k runs outside the three launches but
k's 1/rms.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import conv_taps, conv_taps_backward, conv_weight_taps
from ..linear.kernel_parts import _dot, _phi, _phi_grad
from ..linear.split_kernels import _last_program, _ticket_back


@triton.jit
def _program(H, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(batch·head, tile, batch, head, head channels, which are real, the tile's tokens) of this program."""
    bh, tile_m = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    return bh, tile_m, bh // H, bh % H, d, d < D, tile_m * BLOCK_M + tl.arange(0, BLOCK_M)


@triton.jit
def _norm(RSTD, NW, b, h, N, D, d, d_ok, NORM: tl.constexpr):
    """(this image's per-token 1/rms, this head's RMSNorm weights) of q or k: RSTD (B, N), NW (H·D,) float32."""
    if NORM:
        return RSTD + b * N, tl.load(NW + h * D + d, mask=d_ok, other=0.0)
    return RSTD, tl.zeros_like(d).to(tl.float32)


@triton.jit
def _side(base, s_n, tok, ok, d, d_ok, feature_eps, FEATURE: tl.constexpr, rstd_at, w, NORM: tl.constexpr):
    """One tile of q or k rows ``tok`` (valid ``ok``): (x in float32, φ(x) zero outside the tile); with ``NORM``
    x is MHLA's RMSNorm over heads, applied as the tile loads (x·rstd·w: the token's 1/rms from ``rstd_at``)."""
    rstd = tl.zeros(tok.shape, dtype=tl.float32)
    if NORM:
        rstd = tl.load(rstd_at + tok, mask=ok, other=0.0)
    return _scaled_side(base, s_n, tok, ok, d, d_ok, feature_eps, FEATURE, rstd, w, NORM)


@triton.jit
def _scaled_side(base, s_n, tok, ok, d, d_ok, feature_eps, FEATURE: tl.constexpr, rstd, w, NORM: tl.constexpr):
    """:func:`_side` with the tile's 1/rms given (``rstd``, one per token)."""
    tile = ok[:, None] & d_ok[None, :]
    x = tl.load(base + tok[:, None] * s_n + d[None, :], mask=tile, other=0.0).to(tl.float32)
    if NORM:
        x = x * rstd[:, None] * w[None, :]
    return x, tl.where(tile, _phi(x, FEATURE, feature_eps), 0.0)


@triton.jit
def _tile_rstd(x_at, s_xh, s_xn, t, ok, d, d_ok, H, D, eps):
    """1/rms over all H heads' channels of the tokens ``t`` of one image (x_at: its head 0), float32, as F.rms_norm
    over heads takes it: one tile of every head read, once a program."""
    tile = ok[:, None] & d_ok[None, :]
    total = tl.zeros(t.shape, dtype=tl.float32)
    for head in range(0, H):
        x = tl.load(x_at + head * s_xh + t[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
        total += tl.sum(x * x, axis=1)
    return tl.math.rsqrt(total / (H * D) + eps)


@triton.jit
def _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK: tl.constexpr):
    """Which of the token columns ``cols`` are keys: inside the sequence and, with a mask, valid."""
    ok = cols < N
    if HAS_MASK:
        ok = ok & (tl.load(MASK + b * s_mb + cols, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _weights(W, seg_q, seg_k, G):
    """W̃[s(i), s(j)] of a tile of pairs, float32 (G×G: in cache)."""
    return tl.load(W + seg_q[:, None] * G + seg_k[None, :])


@triton.jit
def _attend(phi_q, seg_q, k_base, v_base, SEG, W, MASK, b, s_mb, s_kn, s_vn, N, G, d, d_ok, feature_eps,
            FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
            rstd_k, w_k, NORM: tl.constexpr):
    """(Σ_j A_ij v_j, Σ_j A_ij) of BLOCK_M queries over every key, float32."""
    num = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    den = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK)
        _, phi_k = _side(k_base, s_kn, cols, ok, d, d_ok, feature_eps, FEATURE, rstd_k, w_k, NORM)
        v = tl.load(v_base + cols[:, None] * s_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        seg_k = tl.load(SEG + cols, mask=cols < N, other=0)
        a = _dot(phi_q.to(TILE), tl.trans(phi_k).to(TILE), PRECISION, EMULATE) * _weights(W, seg_q, seg_k, G)
        num += _dot(a.to(TILE), v.to(TILE), PRECISION, EMULATE)
        den += tl.sum(a, axis=1)
    return num, den


@triton.jit
def pairwise_fwd_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, LW, LB, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_ob, s_oh, s_on,
    H, N, D, G, P, ROWS, COLS, feature_eps, eps, norm_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    HAS_LBIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """o of the BLOCK_M queries of one (batch·head, query tile); ``NORM``: q, k normalised as they load (k with its
    1/rms of RSTD_K, q with its tile's, taken here over every head and written to RSTD_Q by head 0's program for
    backward: (B, N) float32 each); ``LEPE``:
    plus MHLA's LePE, the KS×KS depthwise conv of v (LW: (H·D, KS·KS), LB: (H·D,) float32) over the ROWS×COLS grid
    after P prefix tokens, in the epilogue (:func:`..grid.kernels.conv_taps`: v's rows again, from cache)."""
    bh, tile_m, b, h, d, d_ok, rows = _program(H, D, BLOCK_M, BLOCK_D)
    row_ok = rows < N
    rstd_q, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
    rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
    scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        scale = _tile_rstd(Q + b * s_qb, s_qh, s_qn, rows, row_ok, d, d_ok, H, D, norm_eps)
        tl.store(rstd_q + rows, scale, mask=row_ok & (h == 0))
    _, phi_q = _scaled_side(Q + b * s_qb + h * s_qh, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, scale, w_q,
                            NORM)
    seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
    num, den = _attend(phi_q, seg_q, K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, SEG, W, MASK, b, s_mb,
                       s_kn, s_vn, N, G, d, d_ok, feature_eps, FEATURE, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, TILE,
                       PRECISION, EMULATE, rstd_k, w_k, NORM)
    o = num / (den + eps)[:, None]
    if LEPE:
        o += conv_taps(V + b * s_vb + h * s_vh, s_vn, rows, d, d_ok, LW, LB, MASK, s_mb, b, h, N, D, P, ROWS, COLS,
                       0.0, 0.0, KS, False, HAS_LBIAS, HAS_MASK, BLOCK_M, BLOCK_D)
    tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_on + d[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def pairwise_bwd_dq_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, DO, DQ, RDEN, DDEN, DW, PQ, DWQ, COUNTER,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, N, D, G, feature_eps, eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dq of one (batch·head, query tile), its queries' 1/den and dden (RDEN, DDEN: (B·H, N) float32, for the
    dk/dv kernel) and its part of dW̃ (DW: (B·H, query tiles, BLOCK_G, BLOCK_G) float32). ``NORM``: q is
    MHLA's RMSNorm over heads: the last of the H programs of a query tile to finish (:func:`_norm_tail`) turns
    every head's dq of the normalised q into the raw q's, in place.

    den = Σ_j A_ij + ε, o = num/den; dnum = do/den, dden = −(do·o)/den; dA_ij = dnum_i·v_j + dden_i;
    dφq_i = Σ_j dA_ij W̃_ij φk_j; dW̃[a, c] = Σ_{s(i)=a, s(j)=c} dA_ij φq_i·φk_j.
    """
    bh, tile_m, b, h, d, d_ok, rows = _program(H, D, BLOCK_M, BLOCK_D)
    row_ok = rows < N
    tile = row_ok[:, None] & d_ok[None, :]
    q_base = Q + b * s_qb + h * s_qh
    rstd_q, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
    rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
    _, phi_q = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)
    seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
    k_base, v_base = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh
    num, den = _attend(phi_q, seg_q, k_base, v_base, SEG, W, MASK, b, s_mb, s_kn, s_vn, N, G, d, d_ok, feature_eps,
                       FEATURE, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE, rstd_k, w_k, NORM)
    rden = 1.0 / (den + eps)
    g = tl.load(DO + b * s_gb + h * s_gh + rows[:, None] * s_gn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    dnum = g * rden[:, None]
    dden = -tl.sum(dnum * num, axis=1) * rden  # −(do·o)/den, o = num/den
    tl.store(RDEN + bh * N + rows, rden, mask=row_ok)
    tl.store(DDEN + bh * N + rows, dden, mask=row_ok)
    groups = tl.arange(0, BLOCK_G)
    dphi = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    by_key_segment = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)  # Σ over each key segment of dA_ij P_ij
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK)
        # (k_rows: a name of its own, as the compiler takes a reused one as loop-carried)
        k_rows, phi_k = _side(k_base, s_kn, cols, ok, d, d_ok, feature_eps, FEATURE, rstd_k, w_k, NORM)
        v = tl.load(v_base + cols[:, None] * s_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        seg_k = tl.load(SEG + cols, mask=cols < N, other=0)
        w = _weights(W, seg_q, seg_k, G)
        p = _dot(phi_q.to(TILE), tl.trans(phi_k).to(TILE), PRECISION, EMULATE)
        da = tl.where(ok[None, :], _dot(dnum.to(TILE), tl.trans(v).to(TILE), PRECISION, EMULATE) + dden[:, None],
                      0.0)
        dphi += _dot((da * w).to(TILE), phi_k.to(TILE), PRECISION, EMULATE)
        onehot_k = tl.where(ok[:, None] & (seg_k[:, None] == groups[None, :]), 1.0, 0.0).to(TILE)
        by_key_segment += _dot((da * p).to(TILE), onehot_k, PRECISION, EMULATE)
    onehot_q = tl.where(row_ok[:, None] & (seg_q[:, None] == groups[None, :]), 1.0, 0.0)
    dw = tl.dot(tl.trans(onehot_q), by_key_segment, input_precision="ieee")  # once a program: float32 exact
    q, _ = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)  # (read again:
    dq = dphi * _phi_grad(q, FEATURE)  # registers, not bandwidth, bound this kernel; dq of the normalised q)
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + d[None, :], dq.to(DQ.dtype.element_ty), mask=tile)
    out = DW + (bh * tl.num_programs(1) + tile_m) * BLOCK_G * BLOCK_G
    tl.store(out + groups[:, None] * BLOCK_G + groups[None, :], dw)
    if NORM:
        _norm_tail(Q + b * s_qb, s_qh, s_qn, DQ + b * s_dqb, s_dqh, s_dqn, rstd_q, NW_Q, PQ + b * H * N, DWQ,
                   COUNTER, tl.sum(dq * q, axis=1), b, h, tile_m, rows, tile, d, d_ok, H, N, D, BLOCK_M)


@triton.jit
def pairwise_bwd_dkv_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, LW, DO, RDEN, DDEN, DK, DV, DLW, PK, DWK, COUNTER,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_gb, s_gh, s_gn,
    s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    H, N, D, G, P, ROWS, COLS, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dk, dv of the BLOCK_M keys of one (batch·head, key tile), over every query:
    dv_j = Σ_i A_ij dnum_i, dφk_j = Σ_i dA_ij W̃_ij φq_i (masked keys: zero). ``LEPE``: dv also gets the LePE
    conv's transposed taps of do (:func:`..grid.kernels.conv_taps_backward`), and the conv's dw and dbias of this
    (batch·head) go to DLW ((B·H, KS·KS + 1, D) float32), each program summing every token of some of the taps
    (:func:`..grid.kernels.conv_weight_taps`). ``NORM``: k is MHLA's RMSNorm over heads:
    the last of the H programs of a key tile to finish turns every head's dk into the raw k's (:func:`_norm_tail`)."""
    bh, tile_m, b, h, d, d_ok, cols = _program(H, D, BLOCK_M, BLOCK_D)
    ok = _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK)
    rstd_q, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
    rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
    k, phi_k = _side(K + b * s_kb + h * s_kh, s_kn, cols, ok, d, d_ok, feature_eps, FEATURE, rstd_k, w_k, NORM)
    v = tl.load(V + b * s_vb + h * s_vh + cols[:, None] * s_vn + d[None, :], mask=ok[:, None] & d_ok[None, :],
                other=0.0)
    seg_k = tl.load(SEG + cols, mask=cols < N, other=0)
    q_base, g_base = Q + b * s_qb + h * s_qh, DO + b * s_gb + h * s_gh
    dphi = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        _, phi_q = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)
        g = tl.load(g_base + rows[:, None] * s_gn + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        dnum = g * tl.load(RDEN + bh * N + rows, mask=row_ok, other=0.0)[:, None]
        dden = tl.load(DDEN + bh * N + rows, mask=row_ok, other=0.0)
        seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
        w = _weights(W, seg_q, seg_k, G)  # (BLOCK_N queries, BLOCK_M keys)
        a = _dot(phi_q.to(TILE), tl.trans(phi_k).to(TILE), PRECISION, EMULATE) * w
        dv += _dot(tl.trans(a).to(TILE), dnum.to(TILE), PRECISION, EMULATE)
        da = tl.where(row_ok[:, None], _dot(dnum.to(TILE), tl.trans(v).to(TILE), PRECISION, EMULATE)
                      + dden[:, None], 0.0)
        dphi += _dot(tl.trans(da * w).to(TILE), phi_q.to(TILE), PRECISION, EMULATE)
    if LEPE:
        dv += conv_taps_backward(g_base, s_gn, cols, d, d_ok, LW, MASK, s_mb, b, h, N, D, P, ROWS, COLS, KS,
                                 HAS_MASK, BLOCK_M, BLOCK_D)
    store = (cols < N)[:, None] & d_ok[None, :]  # masked keys get a zero gradient, written
    dk = tl.where(ok[:, None], dphi * _phi_grad(k, FEATURE), 0.0)
    tl.store(DK + b * s_dkb + h * s_dkh + cols[:, None] * s_dkn + d[None, :], dk.to(DK.dtype.element_ty), mask=store)
    tl.store(DV + b * s_dvb + h * s_dvh + cols[:, None] * s_dvn + d[None, :], tl.where(ok[:, None], dv, 0.0)
             .to(DV.dtype.element_ty), mask=store)
    if NORM:
        _norm_tail(K + b * s_kb, s_kh, s_kn, DK + b * s_dkb, s_dkh, s_dkn, rstd_k, NW_K, PK + b * H * N, DWK,
                   COUNTER, tl.sum(dk * k, axis=1), b, h, tile_m, cols, store, d, d_ok, H, N, D, BLOCK_M)
    if LEPE:  # (last: no accumulator is live any more)
        conv_weight_taps(V + b * s_vb + h * s_vh, s_vn, g_base, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS,
                         DLW + bh * (KS * KS + 1) * D, tile_m, tl.num_programs(1), KS, HAS_MASK, BLOCK_M, BLOCK_D)


@triton.jit
def _norm_tail(x_at, s_xh, s_xn, g_at, s_gh, s_gn, rstd_at, NW, P, DW, COUNTER, share, b, h, tile_m, t, tile, d,
               d_ok, H, N, D, BLOCK_M: tl.constexpr):
    """The RMSNorm over heads' backward of a tile of tokens ``t``, once every head's program has written its g (the
    gradient of the normalised x, at g_at + head·s_gh, one image's): this head's ``share`` of the norm's sum,
    Σ_d g·w·x̂ = Σ_d g·y per token (y the normalised x), goes to P (H, N) float32; the last of the H programs of
    the tile to take its ticket (COUNTER: one per (image, tile), zero between launches) makes every head's dx in
    place (:func:`_rms_backward`) and writes the tile's part of dw (DW: (B·tiles, H·D) float32). No float
    atomics: each sum in a fixed order, whichever program is last."""
    ok = t < N
    tl.store(P + h * N + t, share, mask=ok)
    which = b * tl.num_programs(1) + tile_m
    if _last_program(COUNTER, which, H):
        for head in range(0, H):
            w = tl.load(NW + head * D + d, mask=d_ok, other=0.0)
            _rms_backward(x_at + head * s_xh, s_xn, g_at + head * s_gh, s_gn, rstd_at, w, P,
                          DW + which * H * D + head * D, t, tile, d, d_ok, H, N, D, BLOCK_M)
        _ticket_back(COUNTER, which)


@triton.jit
def _rms_backward(x_at, s_xn, g_at, s_gn, rstd_at, w, P, DW_AT, t, tile, d, d_ok, H, N, D, BLOCK_M: tl.constexpr):
    """The RMSNorm over heads' backward, y = x̂·w with x̂ = x·rstd, of one head's channels of tokens ``t``, in
    place: g (the gradient of y, at g_at) becomes dx = rstd·(g·w − x̂·Σ_c g·w·x̂ / C), the sum over all C = H·D
    channels from each head's share (P: (H, N) float32); this head's part of dw, Σ_t g·x̂, goes to DW_AT (D float32).
    g and P were written by other programs of this launch: read from L2 (``.cg``), not a stale L1."""
    ok = t < N
    x = tl.load(x_at + t[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    g = tl.load(g_at + t[:, None] * s_gn + d[None, :], mask=tile, other=0.0, cache_modifier=".cg").to(tl.float32)
    rstd = tl.load(rstd_at + t, mask=ok, other=0.0)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for head in range(0, H):  # (a fixed order: the same sum for every head)
        total += tl.load(P + head * N + t, mask=ok, other=0.0, cache_modifier=".cg")
    x_hat = x * rstd[:, None]
    dx = rstd[:, None] * (g * w[None, :] - x_hat * (total / (H * D))[:, None])
    tl.store(g_at + t[:, None] * s_gn + d[None, :], dx.to(g_at.dtype.element_ty), mask=tile)
    tl.store(DW_AT + d, tl.sum(g * x_hat, axis=0), mask=d_ok)
