"""The pieces of the Triton kernels of non-causal linear attention (state pass, read-out pass, their backward
passes), which :mod:`.split_kernels` (a program per token range) and :mod:`.head_kernels` (a program per head)
put together.

One shape serves ELU, ReLU, InLine and MHLA. Tokens fall into *segments* (all tokens for the kernel variants and
InLine; MHLA's spatial blocks plus one prefix segment), each segment s gets a state over its keys

    S_s = Σ_j m_j φ(k_j) v_jᵀ (d×d),   z_s = Σ_j m_j φ(k_j),   zv_s = Σ_j m_j v_j    (m_j: the key mask)

and each query of segment a reads a state R_a, which the state kernel's last program makes from the S_s (MHLA's
mixing by W̃ too: :mod:`.mixing_parts`):

    normalised:  o_i = φ(q_i)ᵀ R_a / (φ(q_i)·r_a + ε)       (kernel attention, MHLA)
    affine:      o_i = q_iᵀ R_a + b_a                         (InLine)

A program walks its tokens in chunks of BLOCK_N: loads are bf16/fp16 tiles, φ is made in the dots' operand dtype (ELU's
and ReLU's on bf16 pairs: :func:`_phi_tile`) or in float32 where float32 reads it, the normaliser's reciprocal in
float32, and the dots run on tensor cores with float32 accumulators on TILE operands: bf16 for bf16 inputs of ELU, ReLU
and InLine (a third fewer instructions, the tests' bf16 bars held), float32 as TF32 for the other half inputs
(float16's range is too short for a long sequence's sums), or float32 inputs as torch's TF32 switch says. Sums over a
chunk's tokens that would otherwise be reduced across warps every chunk (ELU's z, the normaliser φ(q)·r, the read-out
backward's do·o) are dots on the operand already made (per-query factors come out in the dots' layout, so no float32
tile changes layout through shared memory), the others wait in registers until after the loop; whole chunks run without
bounds masks (FULL). Backward recomputes φ from q and k, so nothing N-sized beyond q, k, v and the output is kept.
Instructions per main loop: benchmarks/kernel_instructions.py. The dots and the sums taken as dots: :mod:`.dots`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bf16_pairs import _elu_plus_one_pairs, _relu_pairs
from .dots import (
    COLS,
    DOT_SUMS_MAX,
    _add_row_sums,
    _denominator,
    _dot,
    _row_dot,
    _row_products,
)

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
def _phi_tile(x, FEATURE: tl.constexpr, feature_eps, TILE: tl.constexpr, EMULATE: tl.constexpr):
    """φ(x) as a dot's operand, in the TILE dtype, from x as loaded: ELU's and ReLU's of bf16 on bf16 tiles on pairs
    of entries (:mod:`.bf16_pairs`; compiled: the interpreter runs no PTX, it takes float32's φ rounded, the same
    values)."""
    if FEATURE == 1 and x.dtype == tl.bfloat16 and TILE == tl.bfloat16 and not EMULATE:
        y = _elu_plus_one_pairs(x)
    elif FEATURE == 2 and x.dtype == tl.bfloat16 and TILE == tl.bfloat16 and not EMULATE:
        y = _relu_pairs(x)
    else:
        y = _phi(x.to(tl.float32), FEATURE, feature_eps).to(TILE)
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
def _phi_grad_rows(q, p, rows, FEATURE: tl.constexpr):
    """φ'(q) ⊙ ``rows`` (1/den, a (BLOCK_N, 1) factor per query) in float32, given p = φ(q) ⊙ rows: elu + 1's φ' is
    min(φ, 1), so min(p, rows) (no second eˣ, no product); relu's a select on p > 0 (φ > 0 where q > 0: no float32
    q), relu + ε's on q > 0. Made from p, in the layout p is made in."""
    if FEATURE == 1:
        y = tl.minimum(p, rows)
    elif FEATURE == 2:
        y = tl.where(p > 0, rows, 0.0)
    elif FEATURE == 3:
        y = tl.where(q > 0, rows, 0.0)
    else:
        y = rows + tl.zeros(q.shape, tl.float32)
    return y


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
def _full_end(begin, end, BLOCK_N: tl.constexpr):
    """Where the whole chunks of ``begin..end`` end: they run without bounds masks (FULL), the rest with them."""
    return begin + (end - begin) // BLOCK_N * BLOCK_N


@triton.jit
def _load(base, tok, d, s_n, tile, FULL: tl.constexpr):
    """A (tokens, head) tile as stored; ``tile``: which entries exist (FULL: all, no mask)."""
    if FULL:
        x = tl.load(base + tok[:, None] * s_n + d[None, :])
    else:
        x = tl.load(base + tok[:, None] * s_n + d[None, :], mask=tile, other=0.0)
    return x


@triton.jit
def _store(base, tok, d, s_n, x, tile, FULL: tl.constexpr):
    if FULL:
        tl.store(base + tok[:, None] * s_n + d[None, :], x.to(base.dtype.element_ty))
    else:
        tl.store(base + tok[:, None] * s_n + d[None, :], x.to(base.dtype.element_ty), mask=tile)


@triton.jit
def _key_tile(k_base, v_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, HAS_MASK: tl.constexpr,
              FULL: tl.constexpr):
    """One chunk of keys: (valid rows, valid tile, k and v as stored). FULL: a whole chunk and head (no bounds
    masks; the key mask still zeroes its keys: φ(k) is zeroed outside the tile)."""
    ok = inside
    if HAS_MASK:
        if FULL:
            ok = tl.load(mask_row + tok) != 0
        else:
            ok = ok & (tl.load(mask_row + tok, mask=inside, other=0) != 0)
    tile = ok[:, None] & d_ok[None, :]
    k = _load(k_base, tok, d, s_kn, tile, FULL and not HAS_MASK)
    v = _load(v_base, tok, d, s_vn, tile, FULL and not HAS_MASK)
    return ok, tile, k, v


@triton.jit
def _add_to_state(acc, z_cols, z_rows, zv_rows, phi_k, v, FEATURE: tl.constexpr, SUM_V: tl.constexpr,
                  TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """S += φ(k)ᵀ v over one chunk (φ(k) in the TILE dtype: :func:`_phi_tile`), and z += φ(k), zv += v (SUM_V)
    without a reduction across warps per chunk: elu + 1's z as a dot on S's operand (``z_cols``: (d, :data:`COLS`),
    each column z: its exp runs once, in the dot's layout); the others' in registers, token rows summed after the
    loop (``z_rows``, ``zv_rows``; fewer instructions than the dot), or per chunk where one row (fewer registers)."""
    phi_t = tl.trans(phi_k)
    acc += _dot(phi_t, v.to(TILE), PRECISION, EMULATE)
    if FEATURE == 1 and phi_k.shape[1] <= DOT_SUMS_MAX:
        z_cols += _dot(phi_t, tl.full((phi_k.shape[0], COLS), 1.0, tl.float32).to(TILE), PRECISION, EMULATE)
    elif z_rows.shape[0] == 1:
        z_rows += tl.sum(phi_k.to(tl.float32), axis=0, keep_dims=True)
    else:
        z_rows += phi_k.to(tl.float32)
    if SUM_V and zv_rows.shape[0] == 1:
        zv_rows += tl.sum(v.to(tl.float32), axis=0, keep_dims=True)
    elif SUM_V:
        zv_rows += v.to(tl.float32)
    return acc, z_cols, z_rows, zv_rows


@triton.jit
def _key_sums(z_cols, z_rows, FEATURE: tl.constexpr):
    """z from :func:`_add_to_state`'s sums, after the loop."""
    if FEATURE == 1 and z_cols.shape[0] <= DOT_SUMS_MAX:
        z = tl.max(z_cols, axis=1)  # (every column is z: max picks it exactly)
    else:
        z = tl.sum(z_rows, axis=0)
    return z


@triton.jit
def _weights(w_at, d, d_ok):
    """MHLA's RMSNorm weights of a head (at ``w_at``, in the weight's dtype, unpadded: masked past the head) as a
    float32 row of the chunk's tile, loaded per chunk (from L1): held in registers across the loop they cost the
    read-out's backward many more (docs/performance.md, MHLA's blocked form)."""
    return tl.load(w_at + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def tile_rstd(x_at, s_xh, s_xn, t, ok, d, d_ok, H, D, eps):
    """1/rms over all H heads' channels of the tokens ``t`` of one image (x_at: its head 0), float32, as F.rms_norm
    over heads takes it: one tile of every head read, a head at a time (one tile's registers)."""
    tile = ok[:, None] & d_ok[None, :]
    total = tl.zeros(t.shape, dtype=tl.float32)
    for head in range(0, H):
        x = tl.load(x_at + head * s_xh + t[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
        total += tl.sum(x * x, axis=1)
    return tl.math.rsqrt(total / (H * D) + eps)


@triton.jit
def _token_rstd(rstd_at, x_img, s_xh, s_xn, tok, inside, d, d_ok, H, D, norm_eps, keep, TAKE: tl.constexpr):
    """Each of the tokens' 1/rms over all heads of x (MHLA's RMSNorm): with TAKE taken here from every head's tile of
    them (x_img: the image's head 0; :func:`tile_rstd`) and stored at ``rstd_at`` by the one program of the heads
    that share the tokens that keeps it for backward (``keep``: the others only use what they took), else loaded
    from there."""
    if TAKE:
        rstd = tile_rstd(x_img, s_xh, s_xn, tok, inside, d, d_ok, H, D, norm_eps)
        tl.store(rstd_at + tok, rstd, mask=inside & keep)
    else:
        rstd = tl.load(rstd_at + tok, mask=inside, other=0.0)
    return rstd


@triton.jit
def _state_step(k_base, v_base, mask_row, IDX, seg, L, end, start, d, d_ok, s_kn, s_vn, feature_eps, acc, z_cols,
                z_rows, zv_rows, FEATURE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_INDEX: tl.constexpr,
                SUM_V: tl.constexpr, FULL: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
                PRECISION: tl.constexpr, EMULATE: tl.constexpr, rstd_at=None, w=None, k_img=None, s_kh=0, H=1,
                D=1, norm_eps=0.0, keep=False, TAKE_RSTD: tl.constexpr = False):
    """One chunk of the state pass (:func:`_add_to_state` of :func:`_key_tile`), its valid keys; MHLA's k·rstd·w,
    each key's 1/rms loaded from ``rstd_at`` or with TAKE_RSTD taken over every head of k (k_img, s_kh: the image's
    head 0 and the head stride; ``keep``: stored: :func:`_token_rstd`)."""
    tok, inside = _tokens(IDX, seg, L, end, start, BLOCK_N, HAS_INDEX)
    rstd = None
    if rstd_at is not None:  # (first: no k or v tile held across the loop over heads)
        rstd = _token_rstd(rstd_at, k_img, s_kh, s_kn, tok, inside, d, d_ok, H, D, norm_eps, keep, TAKE_RSTD)
    ok, tile, k, v = _key_tile(k_base, v_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, HAS_MASK, FULL)
    if rstd_at is not None:
        k = k.to(tl.float32) * rstd[:, None] * _weights(w, d, d_ok)
    phi_k = _phi_tile(k, FEATURE, feature_eps, TILE, EMULATE)
    if not FULL or HAS_MASK:
        phi_k = tl.where(tile, phi_k, 0.0)
    acc, z_cols, z_rows, zv_rows = _add_to_state(acc, z_cols, z_rows, zv_rows, phi_k, v, FEATURE, SUM_V, TILE,
                                                 PRECISION, EMULATE)
    return acc, z_cols, z_rows, zv_rows, ok


@triton.jit
def _query_terms(q, g, o, tile, rz, rz_cols, feature_eps, FEATURE: tl.constexpr, FULL: tl.constexpr,
                 TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """(φ(q), φ(q)·r, do·o) per query of the read-out backward. On 16-bit tiles up to :data:`DOT_SUMS_MAX`: φ(q)
    the read-out's operand tile and both sums dots (the forward's :func:`_denominator`, :func:`_row_products`); on
    float32 (TF32) tiles or wider heads φ(q) and the sums in float32 (fewer registers than the dots' operands)."""
    WIDE: tl.constexpr = TILE == tl.float32 or q.shape[1] > DOT_SUMS_MAX
    if WIDE:
        phi_q = _phi(q.to(tl.float32), FEATURE, feature_eps)
    else:
        phi_q = _phi_tile(q, FEATURE, feature_eps, TILE, EMULATE)
    if not FULL:
        phi_q = tl.where(tile, phi_q, 0.0)
    if WIDE:
        den, g_o = tl.sum(phi_q * rz[None, :], axis=1), tl.sum(g.to(tl.float32) * o.to(tl.float32), axis=1)
    else:
        den, g_o = _row_dot(phi_q, rz_cols, PRECISION, EMULATE), _row_products(g, o, TILE, PRECISION, EMULATE)
    return phi_q, den, g_o


@triton.jit
def _read_out(q_base, o_base, tok, tile, d, s_qn, s_on, r_tile, rz, rz_cols, feature_eps, eps,
              FEATURE: tl.constexpr, NORMALISE: tl.constexpr, FULL: tl.constexpr, TILE: tl.constexpr,
              PRECISION: tl.constexpr, EMULATE: tl.constexpr, extra, rstd=None, w=None, d_ok=None):
    """One chunk of queries: o = φ(q) R / (φ(q)·r + ε), or q R + r (affine), plus ``extra`` (a float32 tile, or
    None), stored in o's dtype (one reciprocal of the denominator per query, not a division per entry; ``rz_cols``:
    r as :func:`_row_dot` takes it); q·rstd·w (MHLA's RMSNorm, as it loads) with each query's 1/rms ``rstd`` (``d_ok``:
the head's channels of w)."""
    q = _load(q_base, tok, d, s_qn, tile, FULL)
    if rstd is not None:
        q = q.to(tl.float32) * rstd[:, None] * _weights(w, d, d_ok)
    phi_q = _phi_tile(q, FEATURE, feature_eps, TILE, EMULATE)
    if not FULL:
        phi_q = tl.where(tile, phi_q, 0.0)
    num = _dot(phi_q, r_tile, PRECISION, EMULATE)
    if NORMALISE:
        o = num * (1.0 / (_denominator(phi_q, rz, rz_cols, PRECISION, EMULATE) + eps))[:, None]
    else:
        o = num + rz[None, :]
    if extra is not None:
        o += extra
    _store(o_base, tok, d, s_on, o, tile, FULL)


@triton.jit
def _read_out_backward(q_base, o_base, g_base, dq_base, tok, tile, d, s_qn, s_on, s_gn, s_dqn, r_t, rz, rz_cols, dr,
                       drz, feature_eps, eps, FEATURE: tl.constexpr, NORMALISE: tl.constexpr, FULL: tl.constexpr,
                       TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, inside=None, rstd_at=None,
                       w=None, d_ok=None):
    """One chunk of queries of the read-out's backward: dq stored, dR (as dRᵀ: ``dr``) and dr (``drz``,
    :func:`_add_row_sums`' accumulator) summed on; ``r_t``: Rᵀ as a tile, ``rz_cols``: r as :func:`_denominator`
    takes it; ``o_base`` None: o not kept, do·o = φq·(do Rᵀ)/den from the dot dq takes anyway.

    normalised: dq = φ'(q) ⊙ (do Rᵀ − (do·o) r) / den, dRᵀ = Σ doᵀ (φq/den), dr = −Σ (φq/den)(do·o). φq is the
    read-out's operand tile (:func:`_phi_tile`) and, on 16-bit tiles, den the read-out's; there den and do·o are
    dots on tensor cores (:func:`_query_terms`), so every per-query factor is made in the dots' layout and dq is
    formed there without moving a float32 tile through shared memory. do enters
    the dots as loaded; the 1/den goes on φq's copy for dRᵀ (the B operand, so the transposed operand is do, read
    from its staged tile), and φ'/den comes from that product (:func:`_phi_grad_rows`).
    affine: dq = do Rᵀ, dRᵀ = Σ doᵀ q, db = Σ do.
    ``rstd_at`` (MHLA, normalised): q·rstd·w as it loads (``inside``: the valid queries), dq the gradient of that
    (:mod:`.norm_parts` takes the norm's backward).
    """
    q = _load(q_base, tok, d, s_qn, tile, FULL)
    if rstd_at is not None:
        q = q.to(tl.float32) * tl.load(rstd_at + tok, mask=inside, other=0.0)[:, None] * _weights(w, d, d_ok)
    g = _load(g_base, tok, d, s_gn, tile, FULL)
    grad = _dot(g.to(TILE), r_t, PRECISION, EMULATE)
    if NORMALISE:
        o = g if o_base is None else _load(o_base, tok, d, s_on, tile, FULL)
        phi_q, den, g_o = _query_terms(q, g, o, tile, rz, rz_cols, feature_eps, FEATURE, FULL, TILE, PRECISION,
                                       EMULATE)
        inv_den = 1.0 / (den + eps)
        if o_base is None:  # (the kept o's do·o above is then dead code)
            g_o = tl.sum(phi_q.to(tl.float32) * grad, axis=1) * inv_den
        p = phi_q.to(tl.float32) * inv_den[:, None]
        dr += _dot(tl.trans(g.to(TILE)), p.to(TILE), PRECISION, EMULATE)
        drz = _add_row_sums(drz, p, -g_o, TILE, PRECISION, EMULATE)
        dq = (grad - g_o[:, None] * rz[None, :]) * _phi_grad_rows(q, p, inv_den[:, None], FEATURE)
    else:
        phi_q = _phi(q.to(tl.float32), FEATURE, feature_eps)
        if not FULL:
            phi_q = tl.where(tile, phi_q, 0.0)
        dr += _dot(tl.trans(g.to(TILE)), phi_q.to(TILE), PRECISION, EMULATE)
        drz = _add_row_sums(drz, g, tl.full((g.shape[0],), 1.0, tl.float32), TILE, PRECISION, EMULATE)
        dq = grad * _phi_grad(q.to(tl.float32), FEATURE)
    _store(dq_base, tok, d, s_dqn, dq, tile, FULL)
    return dr, drz


@triton.jit
def _state_backward(k_base, v_base, dk_base, dv_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, s_dkn, s_dvn,
                    ds_t, ds_tile, dz, dzv, feature_eps, FEATURE: tl.constexpr, HAS_MASK: tl.constexpr,
                    HAS_DZV: tl.constexpr, FULL: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
                    EMULATE: tl.constexpr, STORE_DV: tl.constexpr = True, rstd_at=None, w=None):
    """One chunk of keys of the state's backward, dk and (STORE_DV) dv stored: dφk_j = m_j (dS v_j + dz), dv_j =
    m_j (dSᵀ φk_j + dzv), dk = dφk ⊙ φ'(k) (``ds_t``, ``ds_tile``: dSᵀ and dS as tiles; HAS_DZV: dzv is not zero).
    Returns (v as loaded, dv): without STORE_DV the caller adds to dv and stores it, dk's registers free by then.
    ``rstd_at`` (MHLA): k·rstd·w as it loads, dk the gradient of that (:mod:`.norm_parts` takes the norm's)."""
    _, tile, k, v = _key_tile(k_base, v_base, mask_row, tok, inside, d, d_ok, s_kn, s_vn, HAS_MASK, FULL)
    k = k.to(tl.float32)
    if rstd_at is not None:
        k = k * tl.load(rstd_at + tok, mask=inside, other=0.0)[:, None] * _weights(w, d, d_ok)
    phi_k = _phi(k, FEATURE, feature_eps)
    if not FULL or HAS_MASK:
        phi_k = tl.where(tile, phi_k, 0.0)
    dk = (_dot(v.to(TILE), ds_t, PRECISION, EMULATE) + dz[None, :]) * _phi_grad(k, FEATURE)
    dv = _dot(phi_k.to(TILE), ds_tile, PRECISION, EMULATE)
    if HAS_DZV:
        dv += dzv[None, :]
    if HAS_MASK or not FULL:
        dk, dv = tl.where(tile, dk, 0.0), tl.where(tile, dv, 0.0)
    store = inside[:, None] & d_ok[None, :]  # masked keys get a zero gradient, written
    _store(dk_base, tok, d, s_dkn, dk, store, FULL)
    if STORE_DV:
        _store(dv_base, tok, d, s_dvn, dv, store, FULL)
    return v, dv


@triton.jit
def _load_square(P, which, d, d_ok, D):
    """Entry ``which`` of a (…, D, D) float32 tensor, zero-padded to the head tile."""
    return tl.load(P + which * D * D + d[:, None] * D + d[None, :], mask=d_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _store_square(P, which, x, d, d_ok, D):
    tl.store(P + which * D * D + d[:, None] * D + d[None, :], x, mask=d_ok[:, None] & d_ok[None, :])

