"""Triton kernels of ELU, ReLU and InLine where a head's tokens fit one program: forward and backward in one launch
each, the d×d state (and in backward dR and dS) in registers between the passes over the head's tokens, where
the split form (:mod:`.kernel_parts`' state and read-out kernels, one program per token range) writes them to
memory and sums partial states in torch. Built from the same pieces (:mod:`.kernel_parts`' helpers).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dots import COLS, _columns, _row_sums, _row_sums_init
from .kernel_parts import (
    _full_end,
    _key_sums,
    _read_out,
    _read_out_backward,
    _state_backward,
    _state_step,
    _tokens,
)


@triton.jit
def _head_reader(Q, k_base, v_base, mask_row, s_kn, s_vn, N, d, d_ok, feature_eps, scale, FEATURE: tl.constexpr,
                 INLINE: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr, SUM_ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                 EMULATE: tl.constexpr):
    """(R, r, n, z) of one head from all its N keys, float32: kernel attention R = S, r = z; InLine
    R = (s/n)(S − z v̄ᵀ), r = v̄ = zv/n; n the valid keys (at least 1). ``Q``: any pointer (no index table).
    EVEN_D: the head fills its tile, so whole chunks run without masks. SUM_ROWS: the rows of the key sums
    (:func:`_add_to_state`): BLOCK_N, or 1 where registers are short."""
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    z_cols = tl.zeros((BLOCK_D, COLS), dtype=tl.float32)
    z_rows = tl.zeros((SUM_ROWS, BLOCK_D), dtype=tl.float32)
    zv_rows = tl.zeros((SUM_ROWS, BLOCK_D), dtype=tl.float32)
    count = tl.zeros((BLOCK_N,), dtype=tl.float32)
    full_end = 0  # (no chunk without masks unless EVEN_D)
    if EVEN_D:
        full_end = _full_end(0, N, BLOCK_N)
        for start in range(0, full_end, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, Q, 0, N, N, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols, z_rows,
                zv_rows, FEATURE, HAS_MASK, False, INLINE, True, BLOCK_N, TILE, PRECISION, EMULATE)
            if HAS_MASK and INLINE:
                count += ok.to(tl.float32)
        if full_end < N:
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, Q, 0, N, N, full_end, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols, z_rows,
                zv_rows, FEATURE, HAS_MASK, False, INLINE, False, BLOCK_N, TILE, PRECISION, EMULATE)
            if HAS_MASK and INLINE:
                count += ok.to(tl.float32)
    else:
        for start in range(0, N, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, Q, 0, N, N, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols, z_rows,
                zv_rows, FEATURE, HAS_MASK, False, INLINE, False, BLOCK_N, TILE, PRECISION, EMULATE)
            if HAS_MASK and INLINE:
                count += ok.to(tl.float32)
    z = _key_sums(z_cols, z_rows, FEATURE)
    if HAS_MASK:
        n = tl.maximum(tl.sum(count, axis=0), 1.0)
    else:
        n = tl.maximum(tl.sum(count, axis=0) + N, 1.0)
    if INLINE:
        bias = tl.sum(zv_rows, axis=0) / n
        acc = (acc - z[:, None] * bias[None, :]) * (scale / n)
    else:
        bias = z
    return acc, bias, n, z


@triton.jit
def _read_chunk(q_base, o_base, tok, tile, d, s_qn, s_on, r_tile, bias, rz_cols, feature_eps, eps,
                FEATURE: tl.constexpr, INLINE: tl.constexpr, FULL: tl.constexpr, TILE: tl.constexpr,
                PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """:func:`_read_out` of one chunk, affine for InLine, normalised for kernel attention."""
    if INLINE:
        _read_out(q_base, o_base, tok, tile, d, s_qn, s_on, r_tile, bias, rz_cols, feature_eps, eps, FEATURE, False,
                  FULL, TILE, PRECISION, EMULATE, None)
    else:
        _read_out(q_base, o_base, tok, tile, d, s_qn, s_on, r_tile, bias, rz_cols, feature_eps, eps, FEATURE, True,
                  FULL, TILE, PRECISION, EMULATE, None)


@triton.jit
def attention_fwd_kernel(
    Q, K, V, MASK, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_ob, s_oh, s_on,
    H, N, D, feature_eps, eps, scale,
    FEATURE: tl.constexpr, INLINE: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """The whole forward of one (batch·head) in one program, for a head that needs no split: the state stays in
    registers between the two passes over the tokens (no round trip, one launch).

    Kernel attention: o = φ(q) S / (φ(q)·z + ε). InLine (φ = identity): o = q (s/n)(S − z v̄ᵀ) + v̄, v̄ = zv/n.
    """
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    r_mat, bias, _, _ = _head_reader(Q, K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb, s_kn, s_vn,
                                     N, d, d_ok, feature_eps, scale, FEATURE, INLINE, HAS_MASK, EVEN_D, BLOCK_N,
                                     BLOCK_N, BLOCK_D, TILE, PRECISION, EMULATE)
    r_tile = r_mat.to(TILE)
    rz_cols = _columns(bias, TILE)
    q_base, o_base = Q + b * s_qb + h * s_qh, O + b * s_ob + h * s_oh
    if EVEN_D:
        full_end = _full_end(0, N, BLOCK_N)
        for start in range(0, full_end, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            _read_chunk(q_base, o_base, tok, inside[:, None], d, s_qn, s_on, r_tile, bias, rz_cols, feature_eps, eps,
                        FEATURE, INLINE, True, TILE, PRECISION, EMULATE)
        if full_end < N:
            tok, inside = _tokens(Q, 0, N, N, full_end, BLOCK_N, False)
            _read_chunk(q_base, o_base, tok, inside[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, bias,
                        rz_cols, feature_eps, eps, FEATURE, INLINE, False, TILE, PRECISION, EMULATE)
    else:
        for start in range(0, N, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            _read_chunk(q_base, o_base, tok, inside[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, bias,
                        rz_cols, feature_eps, eps, FEATURE, INLINE, False, TILE, PRECISION, EMULATE)


@triton.jit
def _read_chunk_backward(q_base, o_base, g_base, dq_base, tok, tile, d, s_qn, s_on, s_gn, s_dqn, r_t, bias, rz_cols,
                         dr, drz, feature_eps, eps, FEATURE: tl.constexpr, INLINE: tl.constexpr, FULL: tl.constexpr,
                         TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """:func:`_read_out_backward` of one chunk, affine for InLine, normalised for kernel attention."""
    if INLINE:
        dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, tile, d, s_qn, s_on, s_gn, s_dqn, r_t, bias,
                                     rz_cols, dr, drz, feature_eps, eps, FEATURE, False, FULL, TILE, PRECISION, EMULATE)
    else:
        dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, tile, d, s_qn, s_on, s_gn, s_dqn, r_t, bias,
                                     rz_cols, dr, drz, feature_eps, eps, FEATURE, True, FULL, TILE, PRECISION, EMULATE)
    return dr, drz


@triton.jit
def attention_bwd_kernel(
    Q, K, V, MASK, O, DO, DQ, DK, DV,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_ob, s_oh, s_on, s_gb, s_gh, s_gn,
    s_dqb, s_dqh, s_dqn, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    H, N, D, feature_eps, eps, scale,
    FEATURE: tl.constexpr, INLINE: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """The whole backward of one (batch·head) in one program, for a head that needs no split (as the forward's):
    the state recomputed, the read-out's backward (dq; dR and dr summed), the d×d chain (InLine: dS = (s/n) dR,
    dz = −dS v̄, dzv = (dr − dSᵀ z)/n), the state's backward (dk, dv), with every d×d matrix in registers: no
    state, dR or dS crosses memory, one launch where the split form takes three and torch's chain between. With a
    key mask, no chunk without masks (EVEN_D false) and key sums per chunk: registers, which this kernel has none
    to spare of (benchmarks/kernel_resources.py, kernel_instructions.py)."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_base, v_base, mask_row = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb
    if HAS_MASK:  # (the key sums per chunk: without, the masked form spilled registers, with, the other one)
        r_mat, bias, n, z = _head_reader(Q, k_base, v_base, mask_row, s_kn, s_vn, N, d, d_ok, feature_eps, scale,
                                         FEATURE, INLINE, HAS_MASK, EVEN_D, 1, BLOCK_N, BLOCK_D, TILE, PRECISION,
                                         EMULATE)
    else:
        r_mat, bias, n, z = _head_reader(Q, k_base, v_base, mask_row, s_kn, s_vn, N, d, d_ok, feature_eps, scale,
                                         FEATURE, INLINE, HAS_MASK, EVEN_D, BLOCK_N, BLOCK_N, BLOCK_D, TILE, PRECISION,
                                         EMULATE)
    r_t = tl.trans(r_mat).to(TILE)
    rz_cols = _columns(bias, TILE)
    dr = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    drz = _row_sums_init(1, BLOCK_D)
    q_base, o_base, g_base = Q + b * s_qb + h * s_qh, O + b * s_ob + h * s_oh, DO + b * s_gb + h * s_gh
    dq_base = DQ + b * s_dqb + h * s_dqh
    if EVEN_D:
        full_end = _full_end(0, N, BLOCK_N)
        for start in range(0, full_end, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            dr, drz = _read_chunk_backward(q_base, o_base, g_base, dq_base, tok, inside[:, None], d, s_qn, s_on, s_gn,
                                           s_dqn, r_t, bias, rz_cols, dr, drz, feature_eps, eps, FEATURE, INLINE, True,
                                           TILE, PRECISION, EMULATE)
        if full_end < N:
            tok, inside = _tokens(Q, 0, N, N, full_end, BLOCK_N, False)
            dr, drz = _read_chunk_backward(q_base, o_base, g_base, dq_base, tok, inside[:, None] & d_ok[None, :], d,
                                           s_qn, s_on, s_gn, s_dqn, r_t, bias, rz_cols, dr, drz, feature_eps, eps,
                                           FEATURE, INLINE, False, TILE, PRECISION, EMULATE)
    else:
        for start in range(0, N, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            dr, drz = _read_chunk_backward(q_base, o_base, g_base, dq_base, tok, inside[:, None] & d_ok[None, :], d,
                                           s_qn, s_on, s_gn, s_dqn, r_t, bias, rz_cols, dr, drz, feature_eps, eps,
                                           FEATURE, INLINE, False, TILE, PRECISION, EMULATE)
    dr = tl.trans(dr)
    if INLINE:
        ds = dr * (scale / n)
        dz = -tl.sum(ds * bias[None, :], axis=1)
        dzv = (_row_sums(drz) - tl.sum(ds * z[:, None], axis=0)) / n
    else:
        ds, dz, dzv = dr, _row_sums(drz), _row_sums(drz)
    ds_t, ds_tile = tl.trans(ds).to(TILE), ds.to(TILE)
    dk_base, dv_base = DK + b * s_dkb + h * s_dkh, DV + b * s_dvb + h * s_dvh
    if EVEN_D:
        full_end = _full_end(0, N, BLOCK_N)
        for start in range(0, full_end, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, INLINE, True, TILE,
                            PRECISION, EMULATE)
        if full_end < N:
            tok, inside = _tokens(Q, 0, N, N, full_end, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, INLINE, False, TILE,
                            PRECISION, EMULATE)
    else:
        for start in range(0, N, BLOCK_N):
            tok, inside = _tokens(Q, 0, N, N, start, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, INLINE, False, TILE,
                            PRECISION, EMULATE)
