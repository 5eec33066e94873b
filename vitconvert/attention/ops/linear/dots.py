"""The tensor-core dots of the linear-attention kernels (:mod:`.kernel_parts`) and the sums over a chunk's tokens
or a head's channels taken as dots on an operand the chunk stages anyway: a sum across warps per chunk costs a
barrier and a float32 tile through shared memory, a dot with :data:`COLS` columns of ones neither (every column is
the sum, read back by a max). ``EMULATE``: Triton's interpreter, whose dot of 16-bit tiles is wrong, gets the
operands rounded to their dtype and multiplied in float32 (the products a tensor core forms)."""

from __future__ import annotations

import triton
import triton.language as tl

COLS = tl.constexpr(16)  # a tensor-core dot's least N: sums over tokens as dots with COLS columns of ones
DOT_SUMS_MAX = tl.constexpr(64)  # head tiles up to this take those dots (above, ELU's forward spills on sm_90)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b with a float32 accumulator; a and b in the tile dtype (bf16/fp16, or float32 run as PRECISION)."""
    if EMULATE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _row_dot(x, cols, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """x @ r per row of ``x`` as a tensor-core dot on the read-out's operand (``cols``: r in :data:`COLS` columns)."""
    return tl.max(_dot(x, cols, PRECISION, EMULATE), axis=1)


@triton.jit
def _columns(r, TILE: tl.constexpr):
    """r (d,) as :data:`COLS` equal columns in the tile dtype: :func:`_row_dot`'s operand."""
    return (r[:, None] + tl.zeros((r.shape[0], COLS), dtype=tl.float32)).to(TILE)


@triton.jit
def _denominator(phi_q, rz, rz_cols, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """φ(q)·r per query from φ(q) as a tile: up to :data:`DOT_SUMS_MAX` :func:`_row_dot` (``rz_cols``: r as it
    takes it), above a float32 sum; the read-out and its backward both take it (the backward's 1/den the forward's)."""
    if phi_q.shape[1] <= DOT_SUMS_MAX:
        den = _row_dot(phi_q, rz_cols, PRECISION, EMULATE)
    else:
        den = tl.sum(phi_q.to(tl.float32) * rz[None, :], axis=1)
    return den


@triton.jit
def _row_products(a, b, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """Σ_k a_ik b_ik per row of two tiles as loaded: products rounded to TILE summed by :func:`_row_dot` on ones."""
    if EMULATE:  # (the interpreter's 16-bit products are wrong: float32's, rounded, are the GPU's)
        ab = (a.to(tl.float32) * b.to(tl.float32)).to(TILE)
    else:
        ab = a.to(TILE) * b.to(TILE)
    return _row_dot(ab, _columns(tl.full((a.shape[1],), 1.0, tl.float32), TILE), PRECISION, EMULATE)


@triton.jit
def _add_row_sums(acc, x, w, TILE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """acc += Σ_i w_i x_i over a chunk's rows: up to :data:`DOT_SUMS_MAX` a dot xᵀ (w in :data:`COLS` columns) on the
    operand the chunk's dR dot stages (``acc``: (BLOCK_D, COLS), each column the sum: no barrier, fewer registers),
    above it rows summed after the loop or, ``acc`` of one row, across warps per chunk (as :func:`_add_to_state`)."""
    if x.shape[1] <= DOT_SUMS_MAX:
        acc += _dot(tl.trans(x.to(TILE)), _columns(w, TILE), PRECISION, EMULATE)
    elif acc.shape[0] == 1:
        acc += tl.sum(x.to(tl.float32) * w[:, None], axis=0, keep_dims=True)
    else:
        acc += x.to(tl.float32) * w[:, None]
    return acc


@triton.jit
def _row_sums_init(BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The zero accumulator of :func:`_add_row_sums` (BLOCK_N: its rows above :data:`DOT_SUMS_MAX`, 1 or BLOCK_N)."""
    if BLOCK_D <= DOT_SUMS_MAX:
        acc = tl.zeros((BLOCK_D, COLS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    return acc


@triton.jit
def _row_sums(acc):
    """The (d,) sum of :func:`_add_row_sums`' accumulator."""
    if acc.shape[1] == COLS and acc.shape[0] <= DOT_SUMS_MAX:
        total = tl.max(acc, axis=1)  # (every column is the sum: max picks it exactly)
    else:
        total = tl.sum(acc, axis=0)
    return total
