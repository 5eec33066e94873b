"""The split form of the linear-attention kernels: one program per (batch·head, segment, token range), partial d×d
states written per program and summed by the caller (deterministic; no atomics). MHLA's blocked op runs on them,
and ELU/ReLU/InLine where a head's tokens are split over programs (:func:`.dispatch.split_tokens`); the one-launch
kernels of a whole head are :mod:`.head_kernels`. Built from :mod:`.triton_kernels`' pieces.

Without an index table and with a head that fills its tile (``EVEN_D``), each range's whole chunks run without
bounds masks and the last, partial one with them (:func:`.triton_kernels._full_end`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import (
    COLS,
    _columns,
    _full_end,
    _key_sums,
    _load_row,
    _load_square,
    _read_out,
    _read_out_backward,
    _state_backward,
    _state_step,
    _store_row,
    _store_square,
    _tokens,
)


@triton.jit
def state_fwd_kernel(
    K, V, MASK, IDX, S, Z, ZV,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr, SUM_V: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """Partial S, z, zv of one (batch·head, segment, token range): S/Z/ZV are (BH, SEGMENTS, SPLITS, D[, D]) float32;
    zv only with SUM_V (InLine's: the others read no zv). EVEN_D: the head fills its tile (D = BLOCK_D), so the
    whole chunks of a range without an index table run without masks."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_base, v_base, mask_row = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    z_cols = tl.zeros((BLOCK_D, COLS), dtype=tl.float32)
    z_rows = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    zv_rows = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, _ = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, False, SUM_V, True, BLOCK_N, TILE, PRECISION, EMULATE)
        if full_end < end:
            acc, z_cols, z_rows, zv_rows, _ = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, full_end, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, False, SUM_V, False, BLOCK_N, TILE, PRECISION, EMULATE)
    else:
        for start in range(begin, end, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, _ = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, HAS_INDEX, SUM_V, False, BLOCK_N, TILE, PRECISION, EMULATE)
    out = (bh * SEGMENTS + seg) * SPLITS + split
    _store_square(S, out, acc, d, d_ok, D)
    _store_row(Z, out, _key_sums(z_cols, z_rows, FEATURE), d, d_ok, D)
    if SUM_V:
        _store_row(ZV, out, tl.sum(zv_rows, axis=0), d, d_ok, D)


@triton.jit
def readout_fwd_kernel(
    Q, R, RZ, O, IDX,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on,
    H, L, D, SEGMENTS, tokens_per_split, feature_eps, eps,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, HAS_INDEX: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """o = φ(q) R / (φ(q)·r + ε), or q R + r (affine), for the queries of one (batch·head, segment, range).

    R is (BH, SEGMENTS, D, D) float32, RZ (BH, SEGMENTS, D): the normaliser r or the bias. EVEN_D: as
    :func:`state_fwd_kernel`'s.
    """
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    r_tile = _load_square(R, which, d, d_ok, D).to(TILE)
    rz = _load_row(RZ, which, d, d_ok, D)
    rz_cols = _columns(rz, TILE)
    q_base, o_base = Q + b * s_qb + h * s_qh, O + b * s_ob + h * s_oh
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            _read_out(q_base, o_base, tok, ok[:, None], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps, eps, FEATURE,
                      NORMALISE, True, TILE, PRECISION, EMULATE)
        if full_end < end:
            tok, ok = _tokens(IDX, seg, L, end, full_end, BLOCK_N, False)
            _read_out(q_base, o_base, tok, ok[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps,
                      eps, FEATURE, NORMALISE, False, TILE, PRECISION, EMULATE)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            _read_out(q_base, o_base, tok, ok[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps,
                      eps, FEATURE, NORMALISE, False, TILE, PRECISION, EMULATE)


@triton.jit
def readout_bwd_kernel(
    Q, R, RZ, O, DO, DQ, DR, DRZ, IDX,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps, eps,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, HAS_INDEX: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dq of each query, and partial dR, dr of the range (the read-out recomputed from q; o is the saved output;
    :func:`_read_out_backward`)."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    r_t = tl.trans(_load_square(R, which, d, d_ok, D)).to(TILE)
    rz = _load_row(RZ, which, d, d_ok, D)
    dr = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    drz = tl.zeros((BLOCK_D,), dtype=tl.float32)
    q_base, o_base, g_base = Q + b * s_qb + h * s_qh, O + b * s_ob + h * s_oh, DO + b * s_gb + h * s_gh
    dq_base = DQ + b * s_dqb + h * s_dqh
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None], d, s_qn, s_on, s_gn,
                                         s_dqn, r_t, rz, dr, drz, feature_eps, eps, FEATURE, NORMALISE, True, TILE,
                                         PRECISION, EMULATE)
        if full_end < end:
            tok, ok = _tokens(IDX, seg, L, end, full_end, BLOCK_N, False)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None] & d_ok[None, :], d, s_qn,
                                         s_on, s_gn, s_dqn, r_t, rz, dr, drz, feature_eps, eps, FEATURE, NORMALISE,
                                         False, TILE, PRECISION, EMULATE)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None] & d_ok[None, :], d, s_qn,
                                         s_on, s_gn, s_dqn, r_t, rz, dr, drz, feature_eps, eps, FEATURE, NORMALISE,
                                         False, TILE, PRECISION, EMULATE)
    out = which * SPLITS + split
    _store_square(DR, out, dr, d, d_ok, D)
    _store_row(DRZ, out, drz, d, d_ok, D)


@triton.jit
def state_bwd_kernel(
    K, V, MASK, IDX, DS, DZ, DZV, DK, DV,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    H, L, D, SEGMENTS, tokens_per_split, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_DZV: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """dk, dv of the keys of one (batch·head, segment, range) from dS, dz and (HAS_DZV) dzv of their segment
    (:func:`_state_backward`)."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    ds = _load_square(DS, which, d, d_ok, D)
    ds_t, ds_tile = tl.trans(ds).to(TILE), ds.to(TILE)
    dz = _load_row(DZ, which, d, d_ok, D)
    dzv = dz  # (unread without HAS_DZV)
    if HAS_DZV:
        dzv = _load_row(DZV, which, d, d_ok, D)
    k_base, v_base, mask_row = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb
    dk_base, dv_base = DK + b * s_dkb + h * s_dkh, DV + b * s_dvb + h * s_dvh
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV, True, TILE,
                            PRECISION, EMULATE)
        if full_end < end:
            tok, inside = _tokens(IDX, seg, L, end, full_end, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV, False, TILE,
                            PRECISION, EMULATE)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV, False, TILE,
                            PRECISION, EMULATE)
