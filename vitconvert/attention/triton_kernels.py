"""Triton kernels of non-causal linear attention: state pass, read-out pass, and their backward passes.

One shape serves ELU, ReLU, InLine and MHLA. Tokens fall into *segments* (all tokens for the kernel variants and
InLine; MHLA's spatial blocks plus one prefix segment), each segment s gets a state over its keys

    S_s = Σ_j m_j φ(k_j) v_jᵀ (d×d),   z_s = Σ_j m_j φ(k_j),   zv_s = Σ_j m_j v_j    (m_j: the key mask)

and each query of segment a reads a state R_a (made from the S_s by the caller, in torch: a d×d affair):

    normalised:  o_i = φ(q_i)ᵀ R_a / (φ(q_i)·r_a + ε)       (kernel attention, MHLA)
    affine:      o_i = q_iᵀ R_a + b_a                         (InLine)

Every program owns one (batch·head, segment, token range) and walks its range in chunks of BLOCK_N tokens:
loads are bf16/fp16 tiles, the feature map, the normaliser and the division stay in float32 registers, and the
dots run on tensor cores with float32 accumulators on TILE operands: float32 as TF32 for half inputs (the
kernels are bound by memory, not by the dots, and φ(k), the state R and φ(q) keep 3 more bits than in bf16,
which the cancellation in φ(q)ᵀR needs), or float32 inputs as torch's TF32 switch says. Backward recomputes φ
from q and k, so nothing N-sized beyond q, k, v and the output is kept. Partial states of a token range are
written per program and summed by the caller (deterministic; no atomics).

Under ``TRITON_INTERPRET=1`` (the CPU tests) the interpreter's dot of 16-bit tiles is wrong, so ``EMULATE``
rounds the operands to their dtype and multiplies them in float32: the same products a tensor core forms.
"""

from __future__ import annotations

import triton
import triton.language as tl

IDENTITY, ELU_PLUS_ONE, RELU, RELU_PLUS_EPS = 0, 1, 2, 3  # FEATURE: φ of each variant


@triton.jit
def _phi(x, FEATURE: tl.constexpr, feature_eps):
    """φ(x) in float32."""
    if FEATURE == 1:
        y = tl.where(x > 0, x + 1.0, tl.exp(x))
    elif FEATURE == 2:
        y = tl.maximum(x, 0.0)
    elif FEATURE == 3:
        y = tl.maximum(x, 0.0) + feature_eps
    else:
        y = x
    return y


@triton.jit
def _phi_grad(x, FEATURE: tl.constexpr):
    """φ'(x) in float32 (elu + 1: 1 above 0, eˣ below; relu: the step; identity: 1)."""
    if FEATURE == 1:
        g = tl.where(x > 0, 1.0, tl.exp(x))
    elif FEATURE == 2 or FEATURE == 3:
        g = tl.where(x > 0, 1.0, 0.0)
    else:
        g = tl.full(x.shape, 1.0, tl.float32)
    return g


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b with a float32 accumulator; a and b in the tile dtype (bf16/fp16, or float32 run as PRECISION)."""
    if EMULATE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _tokens(IDX, seg, L, end, start, BLOCK_N: tl.constexpr, HAS_INDEX: tl.constexpr):
    """(token index, validity) of one chunk below ``end``: a slice of the segment's row of the index table
    (L columns, −1 past the segment's tokens), or of 0..L when there is one segment of every token."""
    pos = start + tl.arange(0, BLOCK_N)
    inside = pos < end
    if HAS_INDEX:
        tok = tl.load(IDX + seg * L + pos, mask=inside, other=-1)
        inside = tok >= 0
        tok = tl.where(inside, tok, 0)
    else:
        tok = pos
    return tok, inside


@triton.jit
def _key_tile(k_base, v_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, feature_eps,
              FEATURE: tl.constexpr, HAS_MASK: tl.constexpr):
    """One chunk of keys: (valid rows, valid tile, k in float32, v as stored, φ(k) zero outside the tile)."""
    ok = inside
    if HAS_MASK:
        ok = ok & (tl.load(mask_row + tok, mask=inside, other=0) != 0)
    tile = ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + tok[:, None] * s_kn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    v = tl.load(v_base + tok[:, None] * s_vn + d[None, :], mask=tile, other=0.0)
    return ok, tile, k, v, tl.where(tile, _phi(k, FEATURE, feature_eps), 0.0)


@triton.jit
def _add_to_state(acc, z, zv, phi_k, v, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """S += φ(k)ᵀ v, z += Σ φ(k), zv += Σ v over one chunk."""
    acc += _dot(tl.trans(phi_k.to(TILE)), v.to(TILE), PRECISION, EMULATE)
    return acc, z + tl.sum(phi_k, axis=0), zv + tl.sum(v.to(tl.float32), axis=0)


@triton.jit
def _read_out(q_base, o_base, tok, tile, d, s_qn, s_on, r_tile, rz, feature_eps, eps, FEATURE: tl.constexpr,
              NORMALISE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One chunk of queries: o = φ(q) R / (φ(q)·r + ε), or q R + r (affine), stored in o's dtype."""
    q = tl.load(q_base + tok[:, None] * s_qn + d[None, :], mask=tile, other=0.0)
    phi_q = tl.where(tile, _phi(q.to(tl.float32), FEATURE, feature_eps), 0.0)
    num = _dot(phi_q.to(TILE), r_tile, PRECISION, EMULATE)
    if NORMALISE:
        o = num / (tl.sum(phi_q * rz[None, :], axis=1) + eps)[:, None]
    else:
        o = num + rz[None, :]
    tl.store(o_base + tok[:, None] * s_on + d[None, :], o.to(o_base.dtype.element_ty), mask=tile)


@triton.jit
def _read_out_backward(q_base, o_base, g_base, dq_base, tok, tile, d, s_qn, s_on, s_gn, s_dqn, r_t, rz, dr, drz,
                       feature_eps, eps, FEATURE: tl.constexpr, NORMALISE: tl.constexpr, TILE: tl.constexpr,
                       PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One chunk of queries of the read-out's backward: dq stored, (dR, dr) summed on (``r_t``: Rᵀ as a tile).

    normalised: dnum = do/den, dden = −(do·o)/den, dφq = dnum Rᵀ + dden r, dR = Σ φqᵀ dnum, dr = Σ φq dden.
    affine: dq = do Rᵀ, dR = Σ qᵀ do, db = Σ do.
    """
    q = tl.load(q_base + tok[:, None] * s_qn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    g = tl.load(g_base + tok[:, None] * s_gn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    phi_q = tl.where(tile, _phi(q, FEATURE, feature_eps), 0.0)
    if NORMALISE:
        o = tl.load(o_base + tok[:, None] * s_on + d[None, :], mask=tile, other=0.0).to(tl.float32)
        den = tl.sum(phi_q * rz[None, :], axis=1) + eps
        dnum = g / den[:, None]
        dden = -tl.sum(g * o, axis=1) / den
        dphi = _dot(dnum.to(TILE), r_t, PRECISION, EMULATE) + dden[:, None] * rz[None, :]
        dr += _dot(tl.trans(phi_q.to(TILE)), dnum.to(TILE), PRECISION, EMULATE)
        drz += tl.sum(phi_q * dden[:, None], axis=0)
    else:
        dphi = _dot(g.to(TILE), r_t, PRECISION, EMULATE)
        dr += _dot(tl.trans(phi_q.to(TILE)), g.to(TILE), PRECISION, EMULATE)
        drz += tl.sum(g, axis=0)
    dq = dphi * _phi_grad(q, FEATURE)
    tl.store(dq_base + tok[:, None] * s_dqn + d[None, :], dq.to(dq_base.dtype.element_ty), mask=tile)
    return dr, drz


@triton.jit
def _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn, s_dvn,
                    ds_t, ds_tile, dz, dzv, feature_eps, FEATURE: tl.constexpr, HAS_MASK: tl.constexpr,
                    TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One chunk of keys of the state's backward, dk and dv stored: dφk_j = m_j (dS v_j + dz),
    dv_j = m_j (dSᵀ φk_j + dzv), dk = dφk ⊙ φ'(k) (``ds_t``, ``ds_tile``: dSᵀ and dS as tiles)."""
    _, tile, k, v, phi_k = _key_tile(k_base, v_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, feature_eps,
                                     FEATURE, HAS_MASK)
    dphi = _dot(v.to(TILE), ds_t, PRECISION, EMULATE) + dz[None, :]
    dk = tl.where(tile, dphi * _phi_grad(k, FEATURE), 0.0)
    dv = tl.where(tile, _dot(phi_k.to(TILE), ds_tile, PRECISION, EMULATE) + dzv[None, :], 0.0)
    store = inside[:, None] & d_ok[None, :]  # masked keys get a zero gradient, written
    tl.store(dk_base + tok[:, None] * s_dkn + d[None, :], dk.to(dk_base.dtype.element_ty), mask=store)
    tl.store(dv_base + tok[:, None] * s_dvn + d[None, :], dv.to(dv_base.dtype.element_ty), mask=store)


@triton.jit
def _load_square(P, which, d, d_ok, D):
    """Entry ``which`` of a (…, D, D) float32 tensor, zero-padded to the head tile."""
    return tl.load(P + which * D * D + d[:, None] * D + d[None, :], mask=d_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _store_square(P, which, x, d, d_ok, D):
    tl.store(P + which * D * D + d[:, None] * D + d[None, :], x, mask=d_ok[:, None] & d_ok[None, :])


@triton.jit
def _load_row(P, which, d, d_ok, D):
    """Entry ``which`` of a (…, D) float32 tensor, zero-padded to the head tile."""
    return tl.load(P + which * D + d, mask=d_ok, other=0.0)


@triton.jit
def _store_row(P, which, x, d, d_ok, D):
    tl.store(P + which * D + d, x, mask=d_ok)


@triton.jit
def state_fwd_kernel(
    K, V, MASK, IDX, S, Z, ZV,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Partial S, z, zv of one (batch·head, segment, token range): S/Z/ZV are (BH, SEGMENTS, SPLITS, D[, D]) float32."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    k_base, v_base = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    z = tl.zeros((BLOCK_D,), dtype=tl.float32)
    zv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    for start in range(begin, end, BLOCK_N):
        tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
        _, _, _, v, phi_k = _key_tile(k_base, v_base, MASK + b * s_mb, tok, inside, d, d_ok, s_kn, s_vn,
                                      feature_eps, FEATURE, HAS_MASK)
        acc, z, zv = _add_to_state(acc, z, zv, phi_k, v, TILE, PRECISION, EMULATE)
    out = (bh * SEGMENTS + seg) * SPLITS + split
    _store_square(S, out, acc, d, d_ok, D)
    _store_row(Z, out, z, d, d_ok, D)
    _store_row(ZV, out, zv, d, d_ok, D)


@triton.jit
def readout_fwd_kernel(
    Q, R, RZ, O, IDX,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on,
    H, L, D, SEGMENTS, tokens_per_split, feature_eps, eps,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """o = φ(q) R / (φ(q)·r + ε), or q R + r (affine), for the queries of one (batch·head, segment, range).

    R is (BH, SEGMENTS, D, D) float32, RZ (BH, SEGMENTS, D): the normaliser r or the bias.
    """
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    r_tile = _load_square(R, which, d, d_ok, D).to(TILE)
    rz = _load_row(RZ, which, d, d_ok, D)
    q_base, o_base = Q + b * s_qb + h * s_qh, O + b * s_ob + h * s_oh
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    for start in range(begin, end, BLOCK_N):
        tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
        _read_out(q_base, o_base, tok, ok[:, None] & d_ok[None, :], d, s_qn, s_on, r_tile, rz, feature_eps, eps,
                  FEATURE, NORMALISE, TILE, PRECISION, EMULATE)


@triton.jit
def readout_bwd_kernel(
    Q, R, RZ, O, DO, DQ, DR, DRZ, IDX,
    s_qb, s_qh, s_qn, s_ob, s_oh, s_on, s_gb, s_gh, s_gn, s_dqb, s_dqh, s_dqn,
    H, L, D, SEGMENTS, SPLITS, tokens_per_split, feature_eps, eps,
    FEATURE: tl.constexpr, NORMALISE: tl.constexpr, HAS_INDEX: tl.constexpr,
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
    for start in range(begin, end, BLOCK_N):
        tok, ok = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
        dr, drz = _read_out_backward(q_base, o_base, g_base, dq_base, tok, ok[:, None] & d_ok[None, :], d, s_qn,
                                     s_on, s_gn, s_dqn, r_t, rz, dr, drz, feature_eps, eps, FEATURE, NORMALISE, TILE,
                                     PRECISION, EMULATE)
    out = which * SPLITS + split
    _store_square(DR, out, dr, d, d_ok, D)
    _store_row(DRZ, out, drz, d, d_ok, D)


@triton.jit
def state_bwd_kernel(
    K, V, MASK, IDX, DS, DZ, DZV, DK, DV,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_mb, s_dkb, s_dkh, s_dkn, s_dvb, s_dvh, s_dvn,
    H, L, D, SEGMENTS, tokens_per_split, feature_eps,
    FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """dk, dv of the keys of one (batch·head, segment, range) from dS, dz, dzv of their segment
    (:func:`_state_backward`)."""
    bh, seg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    which = bh * SEGMENTS + seg
    ds = _load_square(DS, which, d, d_ok, D)
    ds_t, ds_tile = tl.trans(ds).to(TILE), ds.to(TILE)
    dz = _load_row(DZ, which, d, d_ok, D)
    dzv = _load_row(DZV, which, d, d_ok, D)
    k_base, v_base = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh
    dk_base, dv_base = DK + b * s_dkb + h * s_dkh, DV + b * s_dvb + h * s_dvh
    begin = split * tokens_per_split
    end = tl.minimum(begin + tokens_per_split, L)
    for start in range(begin, end, BLOCK_N):
        tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
        _state_backward(k_base, v_base, dk_base, dv_base, MASK + b * s_mb, tok, inside, d, d_ok, s_kn, s_vn, s_dkn,
                        s_dvn, ds_t, ds_tile, dz, dzv, feature_eps, FEATURE, HAS_MASK, TILE, PRECISION, EMULATE)
