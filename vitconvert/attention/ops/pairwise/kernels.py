"""Triton kernels of MHLA's attention in its pairwise (N×N) form, FlashAttention's shape without the softmax.

Each token i belongs to a segment s(i) (MHLA's spatial blocks, then one prefix segment), and W̃ (G×G) weighs
every query-key pair by their segments:

    A_ij = φ(q_i)·φ(k_j) · W̃[s(i), s(j)],    o_i = Σ_j A_ij v_j / (Σ_j A_ij + ε)

which is what the blocked form computes from per-segment d×d states (ops/linear/kernel_parts.py). When blocks are small
(7×7 tokens at 224 px, head dim 64) those states are larger than the tokens they sum: G·d·(d+1) float32 per head
against N·d bf16, written, mixed and read again. Here nothing but q, k, v and o crosses memory; the price is
N²·d dots per head, on tensor cores (:func:`.op.pairwise_is_cheaper` picks the form).

The forward's programs own BLOCK_M queries (of one batch·head, or with MHLA's RMSNorm of every head of an image:
the norm's 1/rms is over all heads) and walk the keys in chunks of BLOCK_N (which :func:`.dispatch.launch` may
halve where a GPU's shared memory is short: the grid does not depend on it). The backward is one program per
batch·head, which owns every sum over its tokens (no float atomics, no parts to add up): it recomputes the N×N
weights tile by tile, first over the query tiles (the forward out computed again, as o is not kept; dq; each
query's 1/(Σ A + ε) and −(do·o)/(Σ A + ε) kept on the side; W̃'s gradient through one-hot dots, G ≤ 64), then over
the key tiles (dk, dv). MHLA's RMSNorm over heads needs every head of a token: the forward takes the 1/rms of q and
k as it reads them, and after each side of the backward the last of an image's head programs (a ticket, as the
split kernels take) finishes the norm's backward of that side for every head, so no pass of q or k runs outside the
two launches. W̃ is read as given, its class-token row and column made as it loads (:func:`_weights`), and its
gradient, the norm weights' and LePE's come summed over the batch by last programs, in a fixed order
(:func:`..linear.tickets.batch_total`): no torch op before, between or after the two launches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import conv_taps, conv_taps_backward, conv_weight_taps
from ..linear.kernel_parts import _dot, _phi, _phi_grad, tile_rstd
from ..linear.mixing_parts import lepe_batch_total, mixing_entries
from ..linear.norm_parts import norm_backward
from ..linear.tickets import batch_total


@triton.jit
def _norm(RSTD, NW, b, h, N, D, d, d_ok, NORM: tl.constexpr):
    """(this image's per-token 1/rms, this head's RMSNorm weights in float32) of q or k: RSTD (B, N) float32, NW
    (H·D,) as given (its dtype, unpadded: masked past the head dim)."""
    if NORM:
        return RSTD + b * N, tl.load(NW + h * D + d, mask=d_ok, other=0.0).to(tl.float32)
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
def _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK: tl.constexpr):
    """Which of the token columns ``cols`` are keys: inside the sequence and, with a mask, valid."""
    ok = cols < N
    if HAS_MASK:
        ok = ok & (tl.load(MASK + b * s_mb + cols, mask=ok, other=0) != 0)
    return ok


@triton.jit
def _weights(W, seg_q, seg_k, GW):
    """W̃[s(i), s(j)] of a tile of pairs, float32 (W: GW × GW, in cache; segment GW reads ones:
    :func:`..linear.mixing_parts.mixing_entries`)."""
    return mixing_entries(W, seg_q[:, None], seg_k[None, :], GW)


@triton.jit
def _attend(phi_q, seg_q, k_base, v_base, SEG, W, MASK, b, s_mb, s_kn, s_vn, N, GW, d, d_ok, feature_eps,
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
        a = _dot(phi_q.to(TILE), tl.trans(phi_k).to(TILE), PRECISION, EMULATE) * _weights(W, seg_q, seg_k, GW)
        num += _dot(a.to(TILE), v.to(TILE), PRECISION, EMULATE)
        den += tl.sum(a, axis=1)
    return num, den


@triton.jit
def pairwise_fwd_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, RSTD_K, NW_Q, NW_K, LW, LB, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_ob, s_oh, s_on,
    H, N, D, GW, P, ROWS, COLS, feature_eps, eps, norm_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    HAS_LBIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """o of the BLOCK_M queries of one query tile (grid: (programs, query tiles)) for one batch·head, or with
    ``NORM`` for every head of one image: q and k are MHLA's RMSNorm over heads, normalised as they load, and the
    program first takes the 1/rms over all heads of its query tile and of every key (RSTD_Q, RSTD_K: (B, N)
    float32, written for backward; each program of an image writes the same keys' values, and reads its own back):
    one launch reads k, no pass of its own. ``LEPE``: plus MHLA's LePE, the KS×KS depthwise conv of v (LW: (H·D,
    KS·KS), LB: (H·D,) in the module's dtype, read as float32) over the ROWS×COLS grid after P prefix tokens, in the
    epilogue (:func:`..grid.kernels.conv_taps`: v's rows again, from cache)."""
    program, tile_m = tl.program_id(0), tl.program_id(1)
    if NORM:  # (a program per image: every head's, as the norm's 1/rms is every head's)
        b, first, heads = program, 0, H
    else:
        b, first, heads = program // H, program % H, 1
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        scale = tile_rstd(Q + b * s_qb, s_qh, s_qn, rows, row_ok, d, d_ok, H, D, norm_eps)
        tl.store(RSTD_Q + b * N + rows, scale, mask=row_ok)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            tl.store(RSTD_K + b * N + cols, tile_rstd(K + b * s_kb, s_kh, s_kn, cols, cols < N, d, d_ok, H, D,
                                                       norm_eps), mask=cols < N)
        tl.debug_barrier()  # (every key's 1/rms, stored by this program's threads, before any reads it)
    seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
    for h in range(first, first + heads):
        _, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
        rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
        _, phi_q = _scaled_side(Q + b * s_qb + h * s_qh, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, scale,
                                w_q, NORM)
        num, den = _attend(phi_q, seg_q, K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, SEG, W, MASK, b, s_mb,
                           s_kn, s_vn, N, GW, d, d_ok, feature_eps, FEATURE, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, TILE,
                           PRECISION, EMULATE, rstd_k, w_k, NORM)
        o = num / (den + eps)[:, None]
        if LEPE:
            o += conv_taps(V + b * s_vb + h * s_vh, s_vn, rows, d, d_ok, LW, LB, MASK, s_mb, b, h, N, D, P, ROWS,
                           COLS, 0.0, 0.0, KS, False, HAS_LBIAS, HAS_MASK, BLOCK_M, BLOCK_D)
        tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_on + d[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def pairwise_bwd_kernel(
    Q, K, V, MASK, SEG, W, RSTD_Q, NW_Q, DNW_Q, NCOUNTER_Q, NWG_Q, RSTD_K, NW_K, DNW_K, NCOUNTER_K, NWG_K, LW, DO,
    DQ, DK, DV, DEN, DW, COUNTER, DMIX, DLW, DLB, LWG, LBG,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    B, H, N, D, GW, P, ROWS, COLS, feature_eps, eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr, KS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dq, dk, dv of one batch·head (grid: B·H): one program owns the head, so every sum over tokens is its own, in
    a fixed order, and q, k, v, do are read by one launch. First the query tiles (:func:`_dq_tile`: dq, each
    query's 1/den and dden to DEN (2, B·H, N) float32, W̃'s gradient summed over the tiles to a row of DW (B·H + B
    rows of GW·GW float32), summed over the batch into DMIX (W's dtype) by last programs: tickets COUNTER + 0..B,
    :func:`..linear.tickets.batch_total`), then the key tiles (:func:`_dkv_tile`: dk, dv over every query, reading
    DEN back). ``NORM``: q and k are MHLA's RMSNorm over heads: after each side, the last of the image's H programs
    (a ticket in NCOUNTER_Q, NCOUNTER_K) turns every head's gradient of the normalised q (k) into the raw one's, in
    place, and the image's dw of the norm is summed over the batch into NWG_Q (NWG_K) in the weight's dtype (an
    image's token range of :func:`..linear.norm_parts.norm_backward`; DNW_Q, DNW_K: its 2·B rows of H·D float32).
    ``LEPE``: dv also gets the LePE conv's transposed taps of do, the conv's dw and dbias of this batch·head go to
    DLW (B·H, D, KS·KS) and DLB (B·H, D) float32, in the weight's own layout (:func:`..grid.kernels.conv_weight_taps`),
    and the last of the B·H programs (ticket COUNTER + B + 1) sums them over the batch into LWG (H·D, KS·KS) and LBG
    (H·D) in the weight's dtype (:func:`..linear.mixing_parts.lepe_batch_total`)."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    rstd_q, w_q = _norm(RSTD_Q, NW_Q, b, h, N, D, d, d_ok, NORM)
    rstd_k, w_k = _norm(RSTD_K, NW_K, b, h, N, D, d, d_ok, NORM)
    q_base, k_base, v_base = Q + b * s_qb + h * s_qh, K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh
    g_base = DO + b * s_gb + h * s_gh
    rden_at, dden_at = DEN + bh * N, DEN + (B * H + bh) * N
    groups = tl.arange(0, BLOCK_G)
    dw = tl.zeros((BLOCK_G, BLOCK_G), dtype=tl.float32)
    for start in range(0, N, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        dw += _dq_tile(q_base, s_qn, k_base, s_kn, v_base, s_vn, g_base, s_gn, DQ + b * s_dqb + h * s_dqh, s_dqn,
                       SEG, W, MASK, b, s_mb, rows, rden_at, dden_at, groups, N, GW, d, d_ok, feature_eps, eps,
                       rstd_q, w_q, rstd_k, w_k, FEATURE, HAS_MASK, NORM, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_G, TILE,
                       PRECISION, EMULATE)
    tl.store(DW + bh * GW * GW + groups[:, None] * GW + groups[None, :], dw,
             mask=(groups[:, None] < GW) & (groups[None, :] < GW))
    batch_total(DW, COUNTER, b, B, H, GW * GW, DMIX, BLOCK_G * BLOCK_G)
    if NORM:  # (the image's one token range: the blocked form's norm backward with one segment, one split)
        norm_backward(Q + b * s_qb, s_qh, s_qn, DQ + b * s_dqb, s_dqh, s_dqn, Q, 0, N, 0, N, rstd_q, NW_Q, DNW_Q,
                      NCOUNTER_Q, NWG_Q, b, H, D, 1, 1, 0, d, d_ok, False, BLOCK_M, BLOCK_H, BLOCK_D)
    tl.debug_barrier()  # (each query's 1/den and dden, stored by this program's threads, before any reads them)
    for start in range(0, N, BLOCK_M):
        cols = start + tl.arange(0, BLOCK_M)
        _dkv_tile(q_base, s_qn, k_base, s_kn, v_base, s_vn, g_base, s_gn, DK + b * s_dkb + h * s_dkh, s_dkn,
                  DV + b * s_dvb + h * s_dvh, s_dvn, SEG, W, MASK, LW, b, h, s_mb, cols, rden_at, dden_at, N, GW, D, P,
                  ROWS, COLS, d, d_ok, feature_eps, rstd_q, w_q, rstd_k, w_k, FEATURE, HAS_MASK, NORM, LEPE, KS,
                  BLOCK_M, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    if NORM:
        norm_backward(K + b * s_kb, s_kh, s_kn, DK + b * s_dkb, s_dkh, s_dkn, K, 0, N, 0, N, rstd_k, NW_K, DNW_K,
                      NCOUNTER_K, NWG_K, b, H, D, 1, 1, 0, d, d_ok, False, BLOCK_M, BLOCK_H, BLOCK_D)
    if LEPE:  # (last: no accumulator is live any more)
        conv_weight_taps(v_base, s_vn, g_base, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS,
                         DLW + bh * D * KS * KS, DLB + bh * D, KS, HAS_MASK, BLOCK_M, BLOCK_D)
        lepe_batch_total(DLW, DLB, LWG, LBG, COUNTER, B + 1, B, H, D, KS, BLOCK_H * BLOCK_D)


@triton.jit
def _dq_tile(q_base, s_qn, k_base, s_kn, v_base, s_vn, g_base, s_gn, dq_base, s_dqn, SEG, W, MASK, b, s_mb, rows,
             rden_at, dden_at, groups, N, GW, d, d_ok, feature_eps, eps, rstd_q, w_q, rstd_k, w_k,
             FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, TILE: tl.constexpr,
             PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """dq (of the normalised q, with ``NORM``) of the query tile ``rows``, stored; its 1/den and dden stored at
    rden_at, dden_at; returns the tile's part of dW̃.

    den = Σ_j A_ij + ε, o = num/den; dnum = do/den, dden = −(do·o)/den; dA_ij = dnum_i·v_j + dden_i;
    dφq_i = Σ_j dA_ij W̃_ij φk_j; dW̃[a, c] = Σ_{s(i)=a, s(j)=c} dA_ij φq_i·φk_j (through one-hot dots, G ≤ 64).
    The forward out is computed again (o is not kept)."""
    row_ok = rows < N
    tile = row_ok[:, None] & d_ok[None, :]
    _, phi_q = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)
    seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
    num, den = _attend(phi_q, seg_q, k_base, v_base, SEG, W, MASK, b, s_mb, s_kn, s_vn, N, GW, d, d_ok, feature_eps,
                       FEATURE, HAS_MASK, BLOCK_M, BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE, rstd_k, w_k, NORM)
    rden = 1.0 / (den + eps)
    g = tl.load(g_base + rows[:, None] * s_gn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    dnum = g * rden[:, None]
    dden = -tl.sum(dnum * num, axis=1) * rden  # −(do·o)/den, o = num/den
    tl.store(rden_at + rows, rden, mask=row_ok)
    tl.store(dden_at + rows, dden, mask=row_ok)
    dphi = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    by_key_segment = tl.zeros((BLOCK_M, BLOCK_G), dtype=tl.float32)  # Σ over each key segment of dA_ij P_ij
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK)
        # (k_rows: a name of its own, as the compiler takes a reused one as loop-carried)
        k_rows, phi_k = _side(k_base, s_kn, cols, ok, d, d_ok, feature_eps, FEATURE, rstd_k, w_k, NORM)
        v = tl.load(v_base + cols[:, None] * s_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        seg_k = tl.load(SEG + cols, mask=cols < N, other=0)
        w = _weights(W, seg_q, seg_k, GW)
        p = _dot(phi_q.to(TILE), tl.trans(phi_k).to(TILE), PRECISION, EMULATE)
        da = tl.where(ok[None, :], _dot(dnum.to(TILE), tl.trans(v).to(TILE), PRECISION, EMULATE) + dden[:, None],
                      0.0)
        dphi += _dot((da * w).to(TILE), phi_k.to(TILE), PRECISION, EMULATE)
        onehot_k = tl.where(ok[:, None] & (seg_k[:, None] == groups[None, :]), 1.0, 0.0).to(TILE)
        by_key_segment += _dot((da * p).to(TILE), onehot_k, PRECISION, EMULATE)
    onehot_q = tl.where(row_ok[:, None] & (seg_q[:, None] == groups[None, :]), 1.0, 0.0)
    dw = tl.dot(tl.trans(onehot_q), by_key_segment, input_precision="ieee")  # once a tile: float32 exact
    q, _ = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)  # (read again:
    dq = dphi * _phi_grad(q, FEATURE)  # registers, not bandwidth, bound this loop)
    tl.store(dq_base + rows[:, None] * s_dqn + d[None, :], dq.to(dq_base.dtype.element_ty), mask=tile)
    return dw


@triton.jit
def _dkv_tile(q_base, s_qn, k_base, s_kn, v_base, s_vn, g_base, s_gn, dk_base, s_dkn, dv_base, s_dvn, SEG, W, MASK,
              LW, b, h, s_mb, cols, rden_at, dden_at, N, GW, D, P, ROWS, COLS, d, d_ok, feature_eps, rstd_q, w_q,
              rstd_k, w_k, FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, NORM: tl.constexpr, LEPE: tl.constexpr,
              KS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """dk, dv of the key tile ``cols`` over every query, stored: dv_j = Σ_i A_ij dnum_i, dφk_j = Σ_i dA_ij W̃_ij φq_i
    (masked keys: zero), with each query's 1/den and dden of :func:`_dq_tile`; ``LEPE``: dv also gets the LePE conv's
    transposed taps of do (:func:`..grid.kernels.conv_taps_backward`)."""
    ok = _keys_ok(MASK, b, s_mb, cols, N, HAS_MASK)
    k, phi_k = _side(k_base, s_kn, cols, ok, d, d_ok, feature_eps, FEATURE, rstd_k, w_k, NORM)
    v = tl.load(v_base + cols[:, None] * s_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    seg_k = tl.load(SEG + cols, mask=cols < N, other=0)
    dphi = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        _, phi_q = _side(q_base, s_qn, rows, row_ok, d, d_ok, feature_eps, FEATURE, rstd_q, w_q, NORM)
        g = tl.load(g_base + rows[:, None] * s_gn + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        dnum = g * tl.load(rden_at + rows, mask=row_ok, other=0.0)[:, None]
        dden = tl.load(dden_at + rows, mask=row_ok, other=0.0)
        seg_q = tl.load(SEG + rows, mask=row_ok, other=0)
        w = _weights(W, seg_q, seg_k, GW)  # (BLOCK_N queries, BLOCK_M keys)
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
    tl.store(dk_base + cols[:, None] * s_dkn + d[None, :], dk.to(dk_base.dtype.element_ty), mask=store)
    tl.store(dv_base + cols[:, None] * s_dvn + d[None, :], tl.where(ok[:, None], dv, 0.0)
             .to(dv_base.dtype.element_ty), mask=store)
