"""Triton pieces of the depthwise convs on the patch grid that TTT (q and k) and MHLA (LePE over v) apply.

A (B, H, N, d) tensor x holds P prefix tokens, then a ROWS×COLS grid of spatial tokens; channel (h, c) has its own
KS×KS filter w. With x̂ = x, or the instance-normalised (x − μ)·r (TTT's keys: μ, r per batch and channel, float32),
and m the key mask (1 without one),

    y_t = base_t + bias + Σ_tap w[tap]·(x̂·m)_{t + off(tap)}     (spatial t; zero outside the grid)
    y_t = base_t                                               (prefix t)

with base = x̂ (TTT's residual conv) or a tensor of its own (MHLA: the attention's output). Every tap is a shifted
load of the same rows (L2 holds them), summed in float32 (:func:`conv_taps`), inside the kernels that read x: TTT's
step kernels add their convs to q and k as the tiles load, MHLA's read-out and pairwise kernels add LePE in their
epilogues.

Backward is the transposed gather: dx̂_t = [base is x̂]·dy_t + m_t·Σ_tap w[tap]·dy_{t − off(tap)}
(:func:`conv_taps_backward`), dw = Σ dy_t·(x̂·m)_{t + off} and dbias = Σ dy over grid tokens
(:func:`filter_gradient`); through the norm it is LayerNorm's over the tokens, dx = r·(dx̂ − m·(Σ dx̂ + x̂·Σ dx̂·x̂)/n).
TTT's step kernels take the pieces where a program owns a head: :func:`key_statistics` in its forward,
:func:`residual_conv_backward` in its backward. Where heads split, two kernels run on their own (ops/grid/op.py):
:func:`key_moments_kernel` and :func:`grid_conv_bwd_kernel`, whose partial sums of dw and dbias, and through the norm
of Σ dx̂ and Σ dx̂·x̂ over all tokens, take a first launch (``SUMS``; the last program of each head, and of each
batch·head, sums them in a fixed order) before the second writes dx (``WRITE_DX``); without the norm one launch does
both. A program owns BLOCK_M tokens (the launch grid is made of them). The kernels
take no dots: the settings :func:`.dispatch.launch` passes every kernel and may make leaner (BLOCK_N, TILE,
PRECISION, EMULATE) are accepted and unused, so the grid never depends on them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..linear.tickets import _last_program, _summed, _ticket_back


@triton.jit
def _program(H, N, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(batch·head, tile, batch, head, head channels, which are real, the tile's tokens, which are real)."""
    bh, tile = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    return bh, tile, bh // H, bh % H, d, d < D, t, t < N


@triton.jit
def _position(t, P, N, COLS):
    """(spatial, row, column) of tokens ``t``: whether each is a grid token, and where on the grid."""
    spatial = (t >= P) & (t < N)
    s = tl.where(spatial, t - P, 0)
    return spatial, s // COLS, s % COLS


@triton.jit
def _normed(x_at, s_xn, t, ok, d, d_ok, mean, rstd, NORM: tl.constexpr):
    """x̂ of rows ``t`` where ``ok`` (zero elsewhere), float32; ``x_at``: X + b·s_xb + h·s_xh."""
    tile = ok[:, None] & d_ok[None, :]
    x = tl.load(x_at + t[:, None] * s_xn + d[None, :], mask=tile, other=0.0).to(tl.float32)
    if NORM:
        x = tl.where(tile, (x - mean[None, :]) * rstd[None, :], 0.0)
    return x


@triton.jit
def _row(spatial, row, dr, ROWS):
    """(row, whether on the grid) at row offset ``dr`` of grid tokens (row, ·): what a row of taps shares."""
    r = row + dr
    return r, spatial & (r >= 0) & (r < ROWS)


@triton.jit
def _source(MASK, b, s_mb, r, row_ok, col, dc, P, COLS, HAS_MASK: tl.constexpr):
    """(token, whether it is on the grid and valid) at column offset ``dc`` of row ``r`` (:func:`_row`)."""
    c = col + dc
    ok = row_ok & (c >= 0) & (c < COLS)
    t = P + tl.where(ok, r * COLS + c, 0)
    if HAS_MASK:
        ok = ok & (tl.load(MASK + b * s_mb + t, mask=ok, other=0) != 0)
    return t, ok


@triton.jit
def _statistics(STATS, B, H, D, b, h, d, d_ok, NORM: tl.constexpr):
    """(μ, r) of batch b, head h over the head's channels: STATS is (2, B, H, D) float32."""
    if NORM:
        at = STATS + (b * H + h) * D + d
        return tl.load(at, mask=d_ok, other=0.0), tl.load(at + B * H * D, mask=d_ok, other=0.0)
    return tl.zeros_like(d).to(tl.float32), tl.zeros_like(d).to(tl.float32)


@triton.jit
def conv_taps(x_at, s_xn, t, d, d_ok, WEIGHT, BIAS, MASK, s_mb, b, h, N, D, P, ROWS, COLS, mean, rstd,
              KS: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """bias + Σ_tap w[tap]·(x̂·m)_{t + off(tap)} of tokens ``t`` (zero for prefix tokens and off the grid), float32:
    the conv of one tile without its base, also what TTT's step kernels add to q as its tiles load."""
    spatial, row, col = _position(t, P, N, COLS)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for i in range(KS):  # loops, as the backward's; a row of taps shares its rows' test
        r, row_ok = _row(spatial, row, i - KS // 2, ROWS)
        for j in range(KS):
            src, ok = _source(MASK, b, s_mb, r, row_ok, col, j - KS // 2, P, COLS, HAS_MASK)
            w = tl.load(WEIGHT + (h * D + d) * (KS * KS) + i * KS + j, mask=d_ok, other=0.0).to(tl.float32)
            acc += _normed(x_at, s_xn, src, ok, d, d_ok, mean, rstd, NORM) * w[None, :]
    if HAS_BIAS:
        bias = tl.load(BIAS + h * D + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += tl.where(spatial[:, None], bias[None, :], 0.0)
    return acc


@triton.jit
def conv_taps_backward(dy_at, s_gn, t, d, d_ok, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS, COLS, KS: tl.constexpr,
                       HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """:func:`conv_taps`' backward (no norm) for tokens ``t``: returns m_t·Σ_tap w[tap]·dy_{t − off(tap)}, the
    gradient of x's tokens t as conv inputs (zero for prefix, masked and absent tokens): MHLA's LePE in the
    key tiles of its pairwise backward, dy the attention's do (its dw and dbias: :func:`conv_weight_taps`)."""
    spatial, row, col = _position(t, P, N, COLS)
    valid = spatial
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * s_mb + t, mask=t < N, other=0) != 0)
    dx = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for tap in range(KS * KS):  # (loops, as grid_conv_bwd_kernel's: unrolled taps spill)
        i, j = tap // KS, tap % KS
        w = tl.load(WEIGHT + (h * D + d) * (KS * KS) + tap, mask=d_ok, other=0.0).to(tl.float32)
        r_in, in_ok = _row(valid, row, KS // 2 - i, ROWS)  # (the grid tokens whose tap (i, j) reads these)
        src, ok = _source(MASK, b, s_mb, r_in, in_ok, col, KS // 2 - j, P, COLS, False)
        dx += tl.load(dy_at + src[:, None] * s_gn + d[None, :], mask=ok[:, None] & d_ok[None, :],
                      other=0.0).to(tl.float32) * w[None, :]
    return dx


@triton.jit
def conv_weight_taps(x_at, s_xn, dy_at, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS, DW_AT, DB_AT,
                     KS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dw of :func:`conv_taps` (no norm) in the weight's layout (D rows of KS·KS float32 at DW_AT) and dbias (D
    float32 at DB_AT), by the one program of MHLA's pairwise backward that owns the (batch, head): each sum in a fixed
    order, nothing left to sum but the batch (:func:`filter_gradient` over every tap)."""
    none = tl.zeros_like(d).to(tl.float32)
    filter_gradient(x_at, s_xn, dy_at, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS, DW_AT, 1, KS * KS, DB_AT,
                    none, none, KS, False, HAS_MASK, BLOCK_M, BLOCK_D)


@triton.jit
def filter_gradient(x_at, s_xn, dy_at, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS, DW_AT, s_tap, s_chan, DB_AT,
                    mean, rstd, KS: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dw of :func:`conv_taps`: Σ_t dy_t·(x̂·m)_{t + off(tap)} over all N tokens of one (batch, head), float32,
    channel c of tap i at DW_AT + i·s_tap + c·s_chan, and dbias (Σ over grid tokens of dy, a D row at DB_AT), by the
    one program that owns the (batch, head) (MHLA's pairwise backward, TTT's step kernel): each row written once,
    whole, in a fixed order: nothing left to sum but the batch."""
    for tap in range(0, KS * KS + 1):
        i, j = tap // KS, tap % KS
        total = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for start in range(0, N, BLOCK_M):
            t = start + tl.arange(0, BLOCK_M)
            spatial, row, col = _position(t, P, N, COLS)
            dy = tl.load(dy_at + t[:, None] * s_gn + d[None, :], mask=(t < N)[:, None] & d_ok[None, :],
                         other=0.0).to(tl.float32)
            if tap < KS * KS:
                r_out, out_ok = _row(spatial, row, i - KS // 2, ROWS)  # (the tokens these read as conv outputs)
                src, ok = _source(MASK, b, s_mb, r_out, out_ok, col, j - KS // 2, P, COLS, HAS_MASK)
                total += tl.sum(dy * _normed(x_at, s_xn, src, ok, d, d_ok, mean, rstd, NORM), axis=0)
            else:
                total += tl.sum(tl.where(spatial[:, None], dy, 0.0), axis=0)
        if tap < KS * KS:
            tl.store(DW_AT + tap * s_tap + d * s_chan, total, mask=d_ok)
        else:
            tl.store(DB_AT + d, total, mask=d_ok)


@triton.jit
def _stat_rows(MASK, b, s_mb, t, t_ok, HAS_MASK: tl.constexpr):
    """Which of tokens ``t`` the keys' statistics are over: the real ones, valid under the mask."""
    rows = t_ok
    if HAS_MASK:
        rows = rows & (tl.load(MASK + b * s_mb + t, mask=t_ok, other=0) != 0)
    return rows


@triton.jit
def _tile_moments(x_at, s_xn, MASK, s_mb, b, N, t, d, d_ok, HAS_MASK: tl.constexpr):
    """(count, mean, M2 = Σ(x − mean)²) per channel of the valid ones of tokens ``t``, float32, centred on the tile's
    own mean (no Σx², which loses the variance to rounding where the mean is large beside it)."""
    rows = _stat_rows(MASK, b, s_mb, t, t < N, HAS_MASK)
    ok = rows[:, None] & d_ok[None, :]
    x = tl.load(x_at + t[:, None] * s_xn + d[None, :], mask=ok, other=0.0).to(tl.float32)
    count = tl.sum(tl.where(rows, 1.0, 0.0), axis=0)
    mean = tl.sum(x, axis=0) / tl.maximum(count, 1.0)
    centred = tl.where(ok, x - mean[None, :], 0.0)
    return count, mean, tl.sum(centred * centred, axis=0)


@triton.jit
def _merged(n, mean, m2, n_t, mean_t, m2_t):
    """(count, mean, M2) of two parts' union by Chan, Golub and LeVeque's parallel update: every path takes the key
    statistics as tiles' moments merged in token order, so one program a head and a program a tile round alike."""
    share = n_t / tl.maximum(n + n_t, 1.0)
    delta = mean_t - mean
    return n + n_t, mean + delta * share, m2 + m2_t + delta * delta * (n * share)


@triton.jit
def key_statistics(x_at, s_xn, MASK, s_mb, b, N, d, d_ok, eps, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """(μ, r = 1/√(var + ε)) per channel of one (batch, head)'s tokens (the valid ones), float32, biased variance:
    TTT's key norm in the program that then reads the keys, one pass of tiles' moments merged in order
    (:func:`_merged`; :func:`key_moments_kernel` is the same where a program takes a tile)."""
    n = tl.sum(tl.zeros((BLOCK_M,), dtype=tl.float32), axis=0)
    mean = tl.zeros((BLOCK_D,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, N, BLOCK_M):
        n_t, mean_t, m2_t = _tile_moments(x_at, s_xn, MASK, s_mb, b, N, start + tl.arange(0, BLOCK_M), d, d_ok,
                                          HAS_MASK)
        n, mean, m2 = _merged(n, mean, m2, n_t, mean_t, m2_t)
    return mean, 1.0 / tl.sqrt(m2 / tl.maximum(n, 1.0) + eps)


@triton.jit
def _input_gradient(dy_at, s_gn, t, t_ok, d, d_ok, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS, COLS, KS: tl.constexpr,
                    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dx̂ of tokens ``t`` of a residual conv (y = x̂ + conv(x̂·m)): dy_t + m_t·Σ_tap w[tap]·dy_{t − off(tap)}."""
    dy = tl.load(dy_at + t[:, None] * s_gn + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    return dy.to(tl.float32) + conv_taps_backward(dy_at, s_gn, t, d, d_ok, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS,
                                                  COLS, KS, HAS_MASK, BLOCK_M, BLOCK_D)


@triton.jit
def residual_conv_backward(x_at, s_xn, dy_at, s_gn, dx_at, s_dn, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS, COLS, mean,
                           rstd, DW_AT, DB_AT, KS: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The whole backward of a residual conv y = x̂ + conv(x̂·m) of one (batch, head) in one program, dy in memory
    (written by this program, behind a barrier): dw at DW_AT in the filters' own layout (D × KS·KS), dbias at DB_AT
    (:func:`filter_gradient`), and dx
    stored at ``dx_at``; with ``NORM`` through the instance norm, whose sums over the tokens (Σ dx̂, Σ dx̂·x̂) take a
    pass of their own before dx's. TTT's convs in the program that made their dy: no launch, no partial sums."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    filter_gradient(x_at, s_xn, dy_at, s_gn, d, d_ok, MASK, s_mb, b, N, D, P, ROWS, COLS, DW_AT, 1, KS * KS, DB_AT,
                    mean, rstd, KS, NORM, HAS_MASK, BLOCK_M, BLOCK_D)
    s1 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    count = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM:
        for start in range(0, N, BLOCK_M):
            t = start + tl.arange(0, BLOCK_M)
            dx_hat = _input_gradient(dy_at, s_gn, t, t < N, d, d_ok, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS, COLS,
                                     KS, HAS_MASK, BLOCK_M, BLOCK_D)
            x_hat = _normed(x_at, s_xn, t, t < N, d, d_ok, mean, rstd, NORM)
            s1 += tl.sum(dx_hat, axis=0)
            s2 += tl.sum(dx_hat * x_hat, axis=0)
            count += tl.where(_stat_rows(MASK, b, s_mb, t, t < N, HAS_MASK), 1.0, 0.0)
    n = tl.maximum(tl.sum(count, axis=0), 1.0)
    for start in range(0, N, BLOCK_M):
        t = start + tl.arange(0, BLOCK_M)
        t_ok = t < N
        dx = _input_gradient(dy_at, s_gn, t, t_ok, d, d_ok, WEIGHT, MASK, s_mb, b, h, N, D, P, ROWS, COLS, KS,
                             HAS_MASK, BLOCK_M, BLOCK_D)
        if NORM:
            x_hat = _normed(x_at, s_xn, t, t_ok, d, d_ok, mean, rstd, NORM)
            share = tl.where(_stat_rows(MASK, b, s_mb, t, t_ok, HAS_MASK), 1.0, 0.0) / n
            dx = rstd[None, :] * (dx - share[:, None] * (s1[None, :] + x_hat * s2[None, :]))
        tl.store(dx_at + t[:, None] * s_dn + d[None, :], dx.to(dx_at.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def grid_conv_bwd_kernel(
    X, DY, WEIGHT, MASK, STATS, SUMS_IN, DX, DW, DBIAS, SUMS_OUT, COUNTER, DWF, DBF,
    s_xb, s_xh, s_xn, s_gb, s_gh, s_gn, s_mb, s_db, s_dh, s_dn,
    B, H, N, D, P, ROWS, COLS, TILES,
    KS: tl.constexpr, NORM: tl.constexpr, HAS_MASK: tl.constexpr, SUMS: tl.constexpr, WRITE_DX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Backward of the residual conv y = x̂ + bias + conv(x̂·m) over BLOCK_M tokens of one (batch, head), grid
    (B·H, TILES = ⌈N / BLOCK_M⌉) (TTT's convs where heads split over token ranges). ``SUMS``: this program's partial
    dw (H·B·TILES, KS·KS, D) and dbias (H·B·TILES, D: a head's images and tiles side by side), which the last of a
    head's programs sums in that order into DWF (H·D, KS·KS) and DBF (H·D) (:func:`_filter_totals`; a ticket at
    COUNTER[B·H + h]), and with ``NORM`` the partial Σ dx̂, Σ dx̂·x̂ and valid-token count (3, B·H·TILES, D), which the
    last of a batch·head's programs sums into SUMS_IN (3, B, H, D) (a ticket at COUNTER[bh]). ``WRITE_DX``: dx, with
    ``NORM`` from the summed SUMS_IN (the next launch's: LayerNorm's backward needs every token's sums first)."""
    bh, tile, b, h, d, d_ok, t, t_ok = _program(H, N, D, BLOCK_M, BLOCK_D)
    part = (h * B + b) * TILES + tile
    tile_ok = t_ok[:, None] & d_ok[None, :]
    x_at, dy_at = X + b * s_xb + h * s_xh, DY + b * s_gb + h * s_gh
    mean, rstd = _statistics(STATS, B, H, D, b, h, d, d_ok, NORM)
    spatial, row, col = _position(t, P, N, COLS)
    dy = tl.load(dy_at + t[:, None] * s_gn + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    valid = spatial
    if HAS_MASK:
        valid = valid & (tl.load(MASK + b * s_mb + t, mask=t_ok, other=0) != 0)
    # dx̂ of these tokens as conv inputs: the transposed gather of dy from the tokens whose taps read them
    # Loops, not unrolled: Triton schedules the unrolled taps' loads ahead and spills for sm_90, the loops do not
    # (benchmarks/kernel_resources.py --arch sm_90). Each tap tests its rows itself: held across a row
    # of taps, as the forward's, they cost TTT's kernel a block an SM at head dim 64
    dx_hat = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for tap in range(KS * KS):
        i, j = tap // KS, tap % KS
        w = tl.load(WEIGHT + (h * D + d) * (KS * KS) + tap, mask=d_ok, other=0.0).to(tl.float32)
        if WRITE_DX or NORM:  # (the grid tokens whose tap (i, j) reads these: any, valid or not)
            r_in, in_ok = _row(valid, row, KS // 2 - i, ROWS)
            src, ok = _source(MASK, b, s_mb, r_in, in_ok, col, KS // 2 - j, P, COLS, False)
            reads = ok[:, None] & d_ok[None, :]
            dy_src = tl.load(dy_at + src[:, None] * s_gn + d[None, :], mask=reads, other=0.0)
            dx_hat += dy_src.to(tl.float32) * w[None, :]
        if SUMS:  # dw[tap] over these tokens as conv outputs
            r_out, out_ok = _row(spatial, row, i - KS // 2, ROWS)
            src, ok = _source(MASK, b, s_mb, r_out, out_ok, col, j - KS // 2, P, COLS, HAS_MASK)
            x_src = _normed(x_at, s_xn, src, ok, d, d_ok, mean, rstd, NORM)
            tl.store(DW + (part * (KS * KS) + tap) * D + d, tl.sum(dy * x_src, axis=0), mask=d_ok)
    dx_hat += dy  # (the residual's)
    if SUMS:
        tl.store(DBIAS + part * D + d, tl.sum(tl.where(spatial[:, None], dy, 0.0), axis=0), mask=d_ok)
    if NORM:
        x_hat = _normed(x_at, s_xn, t, t_ok, d, d_ok, mean, rstd, NORM)
        in_stats = _stat_rows(MASK, b, s_mb, t, t_ok, HAS_MASK)
        if SUMS:
            _norm_sums(SUMS_OUT, SUMS_IN, COUNTER, bh, tile, TILES, B * H, tl.sum(dx_hat, axis=0),
                       tl.sum(dx_hat * x_hat, axis=0), tl.sum(tl.where(in_stats, 1.0, 0.0), axis=0), d, d_ok, D)
        if WRITE_DX:
            sums_at = SUMS_IN + bh * D + d
            s1 = tl.load(sums_at, mask=d_ok, other=0.0)
            s2 = tl.load(sums_at + B * H * D, mask=d_ok, other=0.0)
            n = tl.maximum(tl.load(SUMS_IN + (2 * B * H + bh) * D), 1.0)  # (the count: every channel holds it)
            share = tl.where(in_stats, 1.0, 0.0) / n
            dx_hat = rstd[None, :] * (dx_hat - share[:, None] * (s1[None, :] + x_hat * s2[None, :]))
    if WRITE_DX:
        tl.store(DX + b * s_db + h * s_dh + t[:, None] * s_dn + d[None, :], dx_hat.to(DX.dtype.element_ty),
                 mask=tile_ok)
    if SUMS:
        if _last_program(COUNTER, B * H + h, B * TILES):
            _filter_totals(DW, DBIAS, DWF, DBF, h, B * TILES, d, d_ok, D, KS)
            _ticket_back(COUNTER, B * H + h)


@triton.jit
def _norm_sums(SUMS_OUT, SUMS_IN, COUNTER, bh, tile, TILES, BH, s1, s2, count, d, d_ok, D):
    """A program's Σ dx̂, Σ dx̂·x̂ and valid-token count (the count in every channel) as its rows of SUMS_OUT (3,
    B·H·TILES, D); the last of the batch·head's programs sums them in the tiles' order into SUMS_IN (3, B·H, D)."""
    at = SUMS_OUT + (bh * TILES + tile) * D + d
    tl.store(at, s1, mask=d_ok)
    tl.store(at + BH * TILES * D, s2, mask=d_ok)
    tl.store(at + 2 * BH * TILES * D, tl.zeros_like(s1) + count, mask=d_ok)
    if _last_program(COUNTER, bh, TILES):
        for plane in tl.static_range(3):
            tl.store(SUMS_IN + (plane * BH + bh) * D + d,
                     _summed(SUMS_OUT, bh * TILES, TILES, plane * BH * TILES * D, D, d, d_ok), mask=d_ok)
        _ticket_back(COUNTER, bh)


@triton.jit
def _filter_totals(DW, DBIAS, DWF, DBF, h, PARTS, d, d_ok, D, KS: tl.constexpr):
    """Head h's filter gradient (its channels' rows of DWF, (H·D, KS·KS), the weight's own layout) and bias gradient
    (DBF, (H·D)), in the weight's dtype: its PARTS programs' partials summed in their order (deterministic; no float
    atomics)."""
    for tap in range(KS * KS):
        tl.store(DWF + (h * D + d) * (KS * KS) + tap,
                 _summed(DW, h * PARTS, PARTS, tap * D, KS * KS * D, d, d_ok), mask=d_ok)
    tl.store(DBF + h * D + d, _summed(DBIAS, h * PARTS, PARTS, 0, D, d, d_ok), mask=d_ok)


@triton.jit
def key_moments_kernel(
    X, MASK, PART, COUNTER, STATS,
    s_xb, s_xh, s_xn, s_mb,
    B, H, N, D, eps,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
):
    """TTT's key statistics where a program takes BLOCK_M tokens of one (batch, head) (grid as the convs'): each
    stores its tile's moments (:func:`_tile_moments`) as a row of PART (mean, M2, count: 2·D + 1 floats); the last
    of a head's programs (an integer ticket) merges them in token order (:func:`_merged`, as :func:`key_statistics`
    does) into STATS (2, B, H, D): μ and 1/√(var + ε)."""
    bh, tile, b, h, d, d_ok, t, t_ok = _program(H, N, D, BLOCK_M, BLOCK_D)
    tiles = tl.num_programs(1)
    x_at = X + b * s_xb + h * s_xh
    n_t, mean_t, m2_t = _tile_moments(x_at, s_xn, MASK, s_mb, b, N, t, d, d_ok, HAS_MASK)
    row = PART + (bh * tiles + tile) * (2 * D + 1)
    tl.store(row + d, mean_t, mask=d_ok)
    tl.store(row + D + d, m2_t, mask=d_ok)
    tl.store(row + 2 * D, n_t)
    if _last_program(COUNTER, bh, tiles):
        n, mean, m2 = n_t * 0.0, tl.zeros_like(mean_t), tl.zeros_like(m2_t)
        for i in range(0, tiles):
            part = PART + (bh * tiles + i) * (2 * D + 1)
            n, mean, m2 = _merged(n, mean, m2, tl.load(part + 2 * D, cache_modifier=".cg"),
                                  tl.load(part + d, mask=d_ok, other=0.0, cache_modifier=".cg"),
                                  tl.load(part + D + d, mask=d_ok, other=0.0, cache_modifier=".cg"))
        at = STATS + bh * D + d
        tl.store(at, mean, mask=d_ok)
        tl.store(at + B * H * D, 1.0 / tl.sqrt(m2 / tl.maximum(n, 1.0) + eps), mask=d_ok)
        _ticket_back(COUNTER, bh)
