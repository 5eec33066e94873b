"""The split form of the linear-attention kernels: one program per (batch·head, segment, token range), partial d×d
states written per program and summed in a fixed order by the last program of each segment to finish (a ticket per
segment elects it; no float atomics, so the sums are deterministic), which also makes what the next kernel reads:
two launches forward (state, read-out), three backward (state, read-out's backward, state's backward), no torch op
between them. MHLA's blocked op runs on them (the last state program mixes the segments' states by W̃, the read-out
adds LePE: :mod:`.mixing_parts`; all four apply the q/k RMSNorm as their tiles load, each token's 1/rms taken over
every head by the forward's state and read-out programs as they load (kept for backward), and the backward kernels
take its backward by the last program of each token range's heads:
:mod:`.norm_parts`; its R and dS in bf16 where its inputs are: :func:`.launches.square_dtype`), and ELU/ReLU/InLine
where a head's tokens are split over programs (:func:`.dispatch.split_tokens`); the one-launch kernels of a whole head
are :mod:`.head_kernels`. Built from :mod:`.kernel_parts`' pieces.

Without an index table and with a head that fills its tile (``EVEN_D``), each range's whole chunks run without
bounds masks and the last, partial one with them (:func:`.kernel_parts._full_end`). The read-out's and the state
backward's partial chunk is a loop of at most one iteration, not an ``if``: under an ``if`` ptxas kept the two copies
of the body apart and spilled the d×d operands on GPUs whose dots read them from registers (sm_80, sm_86, sm_89,
sm_120), and the read-out took more registers everywhere (benchmarks/kernel_resources.py --arch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..grid.kernels import conv_taps
from .dots import COLS, _columns, _row_sums, _row_sums_init
from .kernel_parts import (
    _full_end,
    _key_sums,
    _load_square,
    _read_out,
    _read_out_backward,
    _state_backward,
    _state_step,
    _store,
    _store_square,
    _token_rstd,
    _tokens,
)
from .mixing_parts import lepe_batch_total, lepe_filter_total, lepe_key_taps, mix_gradients, mix_states
from .norm_parts import norm_backward
from .tickets import _last_program, _partials_summed, _store_partials, _summed, _ticket_back, batch_total


@triton.jit
def _load_row(P, which, d, d_ok, D):
    """Entry ``which`` of a (…, D) float32 tensor, zero-padded to the head tile."""
    return tl.load(P + which * D + d, mask=d_ok, other=0.0)


@triton.jit
def _store_row(P, which, x, d, d_ok, D):
    tl.store(P + which * D + d, x, mask=d_ok)


@triton.jit
def _store_reader(R, RZ, COUNTER, which, square, row, d, d_ok, D):
    """The last program's stores of a d×d square and a row for the next kernel, and its ticket put back."""
    _store_square(R, which, square, d, d_ok, D)
    _store_row(RZ, which, row, d, d_ok, D)
    _ticket_back(COUNTER, which)


@triton.jit
def state_fwd_kernel(
    K, V, MASK, IDX, PART, COUNTER, R, RZ, AUX, NV, W, RSTD, NW,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_rb,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps, scale, keep, GW, norm_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr, INLINE: tl.constexpr,
    SUM_V: tl.constexpr, MIX: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, MIX_CHUNK: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr, NORM: tl.constexpr = False, TAKE_RSTD: tl.constexpr = False,
):
    """What the queries of one (batch·head, segment) read, from its keys split over SPLITS programs (one per token
    range): each stores its partial S, z (and zv, valid keys with SUM_V) as a row of PART (D·D + 2D + 1 floats),
    and the last to finish (:func:`_last_program`) sums them in order and stores R (D, D), RZ (D) and, for InLine's
    backward, AUX = z and NV = n. Kernel attention: R = S, RZ = z, AUX = zv with SUM_V. InLine (SUM_V): R = (s/n)(S
    − z v̄ᵀ), RZ = v̄ = zv/n, n the valid keys. MHLA (MIX): the last of a batch·head's programs mixes its SEGMENTS
    states by W̃ (G ≤ BLOCK_G; GW×GW as given: :mod:`.mixing_parts`): R_a = Σ_s W̃[a, s] S_s, RZ likewise
    (:func:`.mixing_parts.mix_states`; ``keep``: the unmixed ones kept in PART for the backward). EVEN_D: the head
    fills its tile (D = BLOCK_D), so the whole chunks of a range without an index table run without masks. NORM: k
    gets MHLA's RMSNorm over heads as it loads: k·rstd·w, each token's 1/rms over every head from RSTD, or with
    TAKE_RSTD (the forward) taken here over every head's tile of the chunk's keys (ε ``norm_eps``) and stored in RSTD
    by the head-0 program of the range (:func:`.kernel_parts._token_rstd`), the head's weights from NW."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_base, v_base, mask_row = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb
    rstd_at, w = None, None
    if NORM:  # (this image's per-token 1/rms, RSTD (B, s_rb), and this head's weights, NW (H·D,), float32)
        rstd_at, w = RSTD + b * s_rb, NW + h * D
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    z_cols = tl.zeros((BLOCK_D, COLS), dtype=tl.float32)
    z_rows = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    zv_rows = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    count = tl.zeros((BLOCK_N,), dtype=tl.float32)
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, False, SUM_V, True, BLOCK_N, TILE, PRECISION, EMULATE,
                rstd_at, w, K + b * s_kb, s_kh, H, D, norm_eps, h == 0, TAKE_RSTD)
            if SUM_V and HAS_MASK:
                count += ok.to(tl.float32)
        if full_end < end:
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, full_end, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, False, SUM_V, False, BLOCK_N, TILE, PRECISION, EMULATE,
                rstd_at, w, K + b * s_kb, s_kh, H, D, norm_eps, h == 0, TAKE_RSTD)
            if SUM_V and HAS_MASK:
                count += ok.to(tl.float32)
    else:
        for start in range(begin, end, BLOCK_N):
            acc, z_cols, z_rows, zv_rows, ok = _state_step(
                k_base, v_base, mask_row, IDX, seg, L, end, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE, HAS_MASK, HAS_INDEX, SUM_V, False, BLOCK_N, TILE, PRECISION, EMULATE,
                rstd_at, w, K + b * s_kb, s_kh, H, D, norm_eps, h == 0, TAKE_RSTD)
            if SUM_V and HAS_MASK:
                count += ok.to(tl.float32)
    which = bh * SEGMENTS + seg
    width = D * D + 2 * D + 1
    if MIX:
        _store_partials(PART, which * SPLITS + split, width, acc, _key_sums(z_cols, z_rows, FEATURE), d, d_ok, D)
        if _last_program(COUNTER, bh, SEGMENTS * SPLITS):
            mix_states(PART, W, R, RZ, bh, SEGMENTS, GW, SPLITS, width, D, keep, BLOCK_G, MIX_CHUNK)
            _ticket_back(COUNTER, bh)
    else:
        _segment_states(PART, COUNTER, R, RZ, AUX, NV, which, split, SPLITS, width, acc, z_cols, z_rows, zv_rows, count,
                        d, d_ok, L, D, scale, FEATURE, HAS_MASK, INLINE, SUM_V)


@triton.jit
def _segment_states(PART, COUNTER, R, RZ, AUX, NV, which, split, SPLITS, width, acc, z_cols, z_rows, zv_rows, count,
                    d, d_ok, L, D, scale, FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, INLINE: tl.constexpr,
                    SUM_V: tl.constexpr):
    """The state kernel's epilogue without W̃: the partials of a (batch·head, segment) stored, and its last program
    sums them in order and stores what the read-out reads (:func:`state_fwd_kernel`)."""
    if SUM_V:
        out = which * SPLITS + split
        tl.store(PART + out * width + D * D + D + d, tl.sum(zv_rows, axis=0), mask=d_ok)
        if HAS_MASK:
            tl.store(PART + out * width + D * D + 2 * D, tl.sum(count, axis=0))
    last, S, z = _partials_summed(PART, COUNTER, which, split, SPLITS, width, acc, _key_sums(z_cols, z_rows, FEATURE),
                                  d, d_ok, D)
    if last:
        if SUM_V:
            first = which * SPLITS
            zv = _summed(PART, first, SPLITS, D * D + D, width, d, d_ok)
            if HAS_MASK:
                n = tl.maximum(tl.sum(_summed(PART, first, SPLITS, D * D + 2 * D, width, d, d == 0), axis=0), 1.0)
            else:
                n = tl.maximum(L * 1.0, 1.0)
            if INLINE:
                v_mean = zv / n
                _store_row(AUX, which, z, d, d_ok, D)
                tl.store(NV + which, n)
                _store_reader(R, RZ, COUNTER, which, (S - z[:, None] * v_mean[None, :]) * (scale / n), v_mean, d,
                              d_ok, D)
            else:
                _store_row(AUX, which, zv, d, d_ok, D)
                _store_reader(R, RZ, COUNTER, which, S, z, d, d_ok, D)
        else:
            _store_reader(R, RZ, COUNTER, which, S, z, d, d_ok, D)


@triton.jit
def readout_fwd_kernel(
    Q, R, RZ, O, IDX, V, MASK, LW, LB, RSTD, NW,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on, s_vb, s_vh, s_vn, s_mb, s_rb,
    H, L, D, SEGMENTS, tokens_per_split, feature_eps, eps, P, ROWS, COLS, norm_eps,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, HAS_INDEX: tl.constexpr, EVEN_D: tl.constexpr,
    LEPE: tl.constexpr, KS: tl.constexpr, HAS_LBIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
    NORM: tl.constexpr = False,
):
    """o = φ(q) R / (φ(q)·r + ε), or q R + r (affine), for the queries of one (batch·head, segment, range).

    R is (BH, SEGMENTS, D, D) float32, RZ (BH, SEGMENTS, D): the normaliser r or the bias. EVEN_D: as
    :func:`state_fwd_kernel`'s. LEPE (MHLA, with an index table): o also gets LePE, the KS×KS depthwise conv of the
    (masked) v over the ROWS×COLS grid after P prefix tokens (LW (H·D, KS·KS), LB (H·D) float32), in the epilogue
    (:func:`..grid.kernels.conv_taps`). NORM: q gets MHLA's RMSNorm as it loads, each query's 1/rms taken over every
head's tile of the chunk (ε ``norm_eps``) and stored in RSTD by the range's head-0 program, as the state kernel's
TAKE_RSTD does k's.
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
    rstd_at, w = None, None
    if NORM:  # (this image's per-token 1/rms, RSTD (B, s_rb), and this head's weights, NW (H·D,), float32)
        rstd_at, w = RSTD + b * s_rb, NW + h * D
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            rstd = None
            if NORM:
                rstd = _token_rstd(rstd_at, Q + b * s_qb, s_qh, s_qn, tok, ok, d, d_ok, H, D, norm_eps, h == 0, True)
            _read_out(q_base, o_base, tok, ok[:, None], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps, eps, FEATURE,
                      NORMALISE, True, TILE, PRECISION, EMULATE, None, rstd, w, d_ok)
        for start in range(full_end, end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            rstd = None
            if NORM:
                rstd = _token_rstd(rstd_at, Q + b * s_qb, s_qh, s_qn, tok, ok, d, d_ok, H, D, norm_eps, h == 0, True)
            _read_out(q_base, o_base, tok, ok[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps,
                      eps, FEATURE, NORMALISE, False, TILE, PRECISION, EMULATE, None, rstd, w, d_ok)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            lepe, rstd = None, None
            if NORM:
                rstd = _token_rstd(rstd_at, Q + b * s_qb, s_qh, s_qn, tok, ok, d, d_ok, H, D, norm_eps, h == 0, True)
            if LEPE:
                lepe = conv_taps(V + b * s_vb + h * s_vh, s_vn, tok, d, d_ok, LW, LB, MASK, s_mb, b, h,
                                 P + ROWS * COLS, D, P, ROWS, COLS, 0.0, 0.0, KS, False, HAS_LBIAS, HAS_MASK, BLOCK_N,
                                 BLOCK_D)
            _read_out(q_base, o_base, tok, ok[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps,
                      eps, FEATURE, NORMALISE, False, TILE, PRECISION, EMULATE, lepe, rstd, w, d_ok)


@triton.jit
def readout_bwd_kernel(
    Q, R, RZ, O, DO, DQ, PART, COUNTER, AUX, NV, DS, DZ, DZV, IDX, STATES, W, DW, DMIX, RSTD, NW, DNW, NCOUNTER, NWG,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn, s_rb,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps, eps, scale, GW,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, INLINE: tl.constexpr, HAS_INDEX: tl.constexpr,
    HAS_O: tl.constexpr, MIX: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, MIX_CHUNK: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr, NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1,
):
    """dq of each query of one (batch·head, segment, range) (the read-out recomputed from q; o is the saved output, or
    without HAS_O not kept; :func:`_read_out_backward`), its partial dR, dr stored as a row of PART (D·D + D floats),
    and the last program of the segment (:func:`_last_program`) sums them in order into what the state's backward
    reads: dS = dR, dz = dr (kernel attention), or InLine's chain dS = (s/n) dR, dz = −dS v̄, dzv = (dr − dSᵀ z)/n
    from the state kernel's AUX = z and NV = n (v̄ = RZ). MIX (MHLA): the last of the batch·head's programs mixes
    them by W̃ᵀ and writes its dW̃ as a row of DW, against the unmixed states in STATES
    (:func:`.mixing_parts.mix_gradients`), the rows summed over the batch into DMIX (:func:`.tickets.batch_total`).
    NORM (MHLA): q gets its RMSNorm as it loads (RSTD (B, s_rb), NW (H·D,)), and the last of the H programs that
    share a token range (NCOUNTER) turns every head's dq into the raw q's, its range's weight gradient a row of DNW
    (:func:`.norm_parts.norm_tail`), the rows summed over the batch into NWG."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    r_t = tl.trans(_load_square(R, which, d, d_ok, D).to(tl.float32)).to(TILE)  # (R may be bf16: transposed
    # in float32 the loop takes far fewer registers than with a bf16 transpose: kernel_resources.py --arch sm_90)
    rz = _load_row(RZ, which, d, d_ok, D)
    rz_cols = _columns(rz, TILE)
    dr = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    drz = _row_sums_init(BLOCK_N, BLOCK_D)
    q_base, g_base = Q + b * s_qb + h * s_qh, DO + b * s_gb + h * s_gh
    o_base = None
    if HAS_O:
        o_base = O + b * s_ob + h * s_oh
    dq_base = DQ + b * s_dqb + h * s_dqh
    rstd_at, w = None, None
    if NORM:
        rstd_at, w = RSTD + b * s_rb, NW + h * D
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None], d, s_qn, s_on, s_gn,
                                         s_dqn, r_t, rz, rz_cols, dr, drz, feature_eps, eps, FEATURE, NORMALISE, True,
                                         TILE, PRECISION, EMULATE, ok, rstd_at, w, d_ok)
        if full_end < end:
            tok, ok = _tokens(IDX, seg, L, end, full_end, BLOCK_N, False)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None] & d_ok[None, :], d, s_qn,
                                         s_on, s_gn, s_dqn, r_t, rz, rz_cols, dr, drz, feature_eps, eps, FEATURE,
                                         NORMALISE, False, TILE, PRECISION, EMULATE, ok, rstd_at, w, d_ok)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None] & d_ok[None, :], d, s_qn,
                                         s_on, s_gn, s_dqn, r_t, rz, rz_cols, dr, drz, feature_eps, eps, FEATURE,
                                         NORMALISE, False, TILE, PRECISION, EMULATE, ok, rstd_at, w, d_ok)
    if MIX:
        _store_partials(PART, which * SPLITS + split, D * D + D, tl.trans(dr), _row_sums(drz), d, d_ok, D)
        if _last_program(COUNTER, bh, SEGMENTS * SPLITS):
            mix_gradients(PART, STATES, W, DS, DZ, DW, bh, SEGMENTS, GW, SPLITS, D * D + D, D * D + 2 * D + 1, D,
                          BLOCK_G, MIX_CHUNK)
            _ticket_back(COUNTER, bh)
            batch = tl.num_programs(0) // H
            batch_total(DW, COUNTER + batch * H * SEGMENTS, b, batch, H, GW * GW, DMIX, MIX_CHUNK)
    else:
        _segment_gradients(PART, COUNTER, AUX, NV, DS, DZ, DZV, which, split, SPLITS, dr, drz, rz, d, d_ok, D, scale,
                           INLINE)
    if NORM:
        norm_backward(Q + b * s_qb, s_qh, s_qn, DQ + b * s_dqb, s_dqh, s_dqn, IDX, seg, L, begin, end, RSTD + b * s_rb,
                      NW, DNW, NCOUNTER, NWG, b, H, D, SEGMENTS, SPLITS, split, d, d_ok, HAS_INDEX, BLOCK_N,
                      BLOCK_H, BLOCK_D)


@triton.jit
def _segment_gradients(PART, COUNTER, AUX, NV, DS, DZ, DZV, which, split, SPLITS, dr, drz, rz, d, d_ok, D, scale,
                       INLINE: tl.constexpr):
    """The read-out backward's epilogue without W̃ (:func:`readout_bwd_kernel`)."""
    last, d_r, d_rz = _partials_summed(PART, COUNTER, which, split, SPLITS, D * D + D, tl.trans(dr), _row_sums(drz),
                                       d, d_ok, D)
    if last:
        if INLINE:
            n = tl.load(NV + which)
            ds = d_r * (scale / n)
            z = _load_row(AUX, which, d, d_ok, D)
            _store_row(DZV, which, (d_rz - tl.sum(ds * z[:, None], axis=0)) / n, d, d_ok, D)
            _store_reader(DS, DZ, COUNTER, which, ds, -tl.sum(ds * rz[None, :], axis=1), d, d_ok, D)
        else:
            _store_reader(DS, DZ, COUNTER, which, d_r, d_rz, d, d_ok, D)


@triton.jit
def state_bwd_kernel(
    K, V, MASK, IDX, DS, DZ, DZV, DK, DV, DO, LW, LPART, COUNTER, DLW, DLB, LWG, LBG,
    RSTD, NW, DNW, NCOUNTER, NWG,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn, s_gb, s_gh, s_gn,
    s_rb, H, L, D, SEGMENTS, SPLITS, CHUNKS, tokens_per_split, feature_eps, P, ROWS, COLS,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr, HAS_DZV: tl.constexpr,
    LEPE: tl.constexpr, KS: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
    NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1,
):
    """dk, dv of the keys of one (batch·head, segment, range) from dS, dz and (HAS_DZV) dzv of their segment
    (:func:`_state_backward`). LEPE (MHLA, with an index table): dv also gets LePE's taps of do (DO), and each of the
    range's chunks stores its keys' share of the filter's gradient (KS·KS taps and the bias) as a row of LPART
    (CHUNKS rows a program); the last of a batch·head's SEGMENTS·SPLITS programs sums them in order into DLW, DLB,
    and the last batch·head's those over the batch into LWG, LBG (:mod:`.mixing_parts`). NORM (MHLA): k gets its
    RMSNorm as it loads (as in :func:`readout_bwd_kernel`), and the
    last of the H programs that share a token range turns every head's dk into the raw k's."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    rstd_at, w = None, None
    if NORM:
        rstd_at, w = RSTD + b * s_rb, NW + h * D
    ds = _load_square(DS, which, d, d_ok, D)
    ds_t, ds_tile = tl.trans(ds).to(TILE), ds.to(TILE)
    dz = _load_row(DZ, which, d, d_ok, D)
    dzv = dz  # (unread without HAS_DZV)
    if HAS_DZV:
        dzv = _load_row(DZV, which, d, d_ok, D)
    k_base, v_base, mask_row = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh, MASK + b * s_mb
    dk_base, dv_base = DK + b * s_dkb + h * s_dkh, DV + b * s_dvb + h * s_dvh
    if EVEN_D and not HAS_INDEX:
        full_end = _full_end(begin, end, BLOCK_N)
        for start in range(begin, full_end, BLOCK_N):
            tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV, True, TILE,
                            PRECISION, EMULATE, True, rstd_at, w)
        for start in range(full_end, end, BLOCK_N):
            tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, False)
            _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                            s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV, False, TILE,
                            PRECISION, EMULATE, True, rstd_at, w)
    else:
        for start in range(begin, end, BLOCK_N):
            tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
            v, dv = _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn,
                                    s_dkn, s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, HAS_DZV,
                                    False, TILE, PRECISION, EMULATE, not LEPE, rstd_at, w)
            if LEPE:  # (after dk is stored: its registers free)
                dv += lepe_key_taps(DO + b * s_gb + h * s_gh, s_gn, v, tok, inside, d, d_ok, LW, LPART,
                                    (which * SPLITS + split) * CHUNKS + (start - begin) // BLOCK_N, MASK, s_mb, b, h,
                                    D, P, ROWS, COLS, KS, HAS_MASK, BLOCK_N, BLOCK_D)
                _store(dv_base, tok, d, s_dvn, dv, inside[:, None] & d_ok[None, :], False)
        if LEPE:
            if _last_program(COUNTER, bh, SEGMENTS * SPLITS):
                lepe_filter_total(LPART, DLW, DLB, bh, SEGMENTS, SPLITS, CHUNKS, tokens_per_split, L, d, d_ok, D, KS,
                                  BLOCK_N, BLOCK_T)
                _ticket_back(COUNTER, bh)
                lepe_batch_total(DLW, DLB, LWG, LBG, COUNTER, tl.num_programs(0), tl.num_programs(0) // H, H,
                                 D, KS, BLOCK_T * BLOCK_D)
    if NORM:
        norm_backward(K + b * s_kb, s_kh, s_kn, DK + b * s_dkb, s_dkh, s_dkn, IDX, seg, L, begin, end, RSTD + b * s_rb,
                      NW, DNW, NCOUNTER, NWG, b, H, D, SEGMENTS, SPLITS, split, d, d_ok, HAS_INDEX, BLOCK_N,
                      BLOCK_H, BLOCK_D)
