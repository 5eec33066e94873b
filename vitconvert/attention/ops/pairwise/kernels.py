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
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import conv_taps, conv_taps_backward
from ..linear.kernel_parts import _dot, _phi, _phi_grad


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
    tile = ok[:, None] & d_ok[None, :]
    x = tl.load(base + tok[:, None] * s_n + d[None, :], mask=tile, other=0.0).to(tl.float32)
    if NORM:
        x = x * tl.load(rstd_at + tok, mask=ok, other=0.0)[:, None] * w[None, :]
    return x, tl.where(tile, _phi(x, FEATURE, feature_eps), 0.0)


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
    H, N, D, G, P, ROWS, COLS, feature_eps, eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    HAS_LBIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """o of the BLOCK_M queries of one (batch·head, query tile); ``NORM``: q, k normalised as they load; ``LEPE``:
    plus MHLA's LePE, the KS×KS depthwise conv of v (LW: (H·D, KS·KS), LB: (H·D,) float32) over the ROWS×COLS grid
    after P prefix tokens, in the epilogue (:func:`..grid.kernels.conv_taps`: v's rows again, from cache)."""
    bh, tile_m, b, h, d, d_ok, rows = _program(H, D, BLOCK_M, BLOCK_D)
    row_ok = rows < N
    rstd_q, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
    rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
    _, phi_q = _side(Q + b * s_qb + h * s_qh, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)
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
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, DO, DQ, RDEN, DDEN, DW, PQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, N, D, G, feature_eps, eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dq of one (batch·head, query tile), its queries' 1/den and dden (RDEN, DDEN: (B·H, N) float32, for the
    dk/dv kernel) and its part of dW̃ (DW: (B·H, query tiles, BLOCK_G, BLOCK_G) float32). ``NORM``: dq of the
    normalised q, which the dk/dv kernel turns into the raw q's, and this head's share of the norm's backward sum,
    Σ_d dq·w·x̂ per query (PQ: (B·H, N) float32).

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
    if NORM:  # (x̂·w = the normalised q: Σ_d dq·w·x̂ = Σ_d dq·q)
        tl.store(PQ + bh * N + rows, tl.sum(dq * q, axis=1), mask=row_ok)
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + d[None, :], dq.to(DQ.dtype.element_ty), mask=tile)
    out = DW + (bh * tl.num_programs(1) + tile_m) * BLOCK_G * BLOCK_G
    tl.store(out + groups[:, None] * BLOCK_G + groups[None, :], dw)


@triton.jit
def pairwise_bwd_dkv_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, LW, DO, RDEN, DDEN, DK, DV, DLW, DQ, PQ, DWQ,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_gb, s_gh, s_gn,
    s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, s_dqb, s_dqh, s_dqn,
    H, N, D, G, P, ROWS, COLS, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dk, dv of the BLOCK_M keys of one (batch·head, key tile), over every query:
    dv_j = Σ_i A_ij dnum_i, dφk_j = Σ_i dA_ij W̃_ij φq_i (masked keys: zero). ``LEPE``: dv also gets the LePE
    conv's transposed taps of do, and this program's part of the conv's dw and dbias goes to DLW ((B·H, key tiles,
    KS·KS + 1, D) float32; :func:`..grid.kernels.conv_taps_backward`). ``NORM``: also the RMSNorm's backward of
    q at this tile's tokens and head (:func:`_rms_backward`: the dq kernel ran before)."""
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
        dv += conv_taps_backward(V + b * s_vb + h * s_vh, s_vn, g_base, s_gn, cols, d, d_ok, LW, MASK, s_mb, b, h,
                                 N, D, P, ROWS, COLS, DLW + (bh * tl.num_programs(1) + tile_m) * (KS * KS + 1) * D,
                                 KS, HAS_MASK, BLOCK_M, BLOCK_D)
    store = (cols < N)[:, None] & d_ok[None, :]  # masked keys get a zero gradient, written
    if NORM:
        _rms_backward(Q + b * s_qb + h * s_qh, s_qn, DQ + b * s_dqb + h * s_dqh, s_dqn, rstd_q, w_q, PQ + b * H * N,
                      DWQ + (bh * tl.num_programs(1) + tile_m) * D, cols, store, d, d_ok, H, N, D, BLOCK_M)
    dk = tl.where(ok[:, None], dphi * _phi_grad(k, FEATURE), 0.0)
    tl.store(DK + b * s_dkb + h * s_dkh + cols[:, None] * s_dkn + d[None, :], dk.to(DK.dtype.element_ty), mask=store)
    tl.store(DV + b * s_dvb + h * s_dvh + cols[:, None] * s_dvn + d[None, :], tl.where(ok[:, None], dv, 0.0)
             .to(DV.dtype.element_ty), mask=store)



@triton.jit
def _rms_backward(x_at, s_xn, g_at, s_gn, rstd_at, w, P, DW_AT, t, tile, d, d_ok, H, N, D, BLOCK_M: tl.constexpr):
    """The RMSNorm over heads' backward (as :func:`rms_heads_bwd_kernel`'s) of one head's channels of tokens
    ``t``, in place: g (the gradient of the normalised x, at g_at) becomes dx = rstd·(g·w − x̂·Σ_c g·w·x̂ / C), the
    sum over all H·D channels from each head's share (P: (H, N) float32, the dq kernel's); this head's part of dw,
    Σ_t g·x̂, goes to DW_AT (D float32)."""
    ok = t < N
    x = tl.load(x_at + t[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    g = tl.load(g_at + t[:, None] * s_gn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_at + t, mask=ok, other=0.0)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for head in range(0, H):  # (a fixed order: the same sum for every head's program)
        total += tl.load(P + head * N + t, mask=ok, other=0.0)
    x_hat = x * rstd[:, None]
    dx = rstd[:, None] * (g * w[None, :] - x_hat * (total / (H * D))[:, None])
    tl.store(g_at + t[:, None] * s_gn + d[None, :], dx.to(g_at.dtype.element_ty), mask=tile)
    tl.store(DW_AT + d, tl.sum(g * x_hat, axis=0), mask=d_ok)


@triton.jit
def rms_heads_bwd_kernel(
    X, G, RSTD, NW, DX, DW,
    s_xb, s_xn, s_gb, s_gn, s_db, s_dn,
    N, C,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """The backward of MHLA's RMSNorm over heads, y = x·rstd·w, for BLOCK_T tokens of one image (grid (B, token
    tiles)): dx = rstd·(g·w − x̂·mean(g·w·x̂)), x̂ = x·rstd, over each token's C = H·d channels (contiguous in x, g
    and dx), and this program's part of dw = Σ g·x̂ (DW: (B·tiles, C) float32). ``G``: the gradient of y (the
    pairwise kernels' dq or dk, of the normalised q or k); RSTD (B, N) and NW (C,) float32. No dots: the settings
    :func:`.dispatch.launch` passes every kernel (BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE) are unused."""
    b, tile = tl.program_id(0), tl.program_id(1)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    ok = (t < N)[:, None] & (c < C)[None, :]
    x = tl.load(X + b * s_xb + t[:, None] * s_xn + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + b * s_gb + t[:, None] * s_gn + c[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + b * N + t, mask=t < N, other=0.0)
    w = tl.load(NW + c, mask=c < C, other=0.0)
    x_hat = x * rstd[:, None]
    gw = g * w[None, :]
    mean = tl.sum(gw * x_hat, axis=1) / C
    dx = rstd[:, None] * (gw - x_hat * mean[:, None])
    tl.store(DX + b * s_db + t[:, None] * s_dn + c[None, :], dx.to(DX.dtype.element_ty), mask=ok)
    tl.store(DW + (b * tl.num_programs(1) + tile) * C + c, tl.sum(g * x_hat, axis=0), mask=c < C)
