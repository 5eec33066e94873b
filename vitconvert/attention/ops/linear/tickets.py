"""The tickets that elect the last program of a group in the split kernels (:mod:`.split_kernels`), the grid
kernels, the pairwise backward and TTT's: an integer counter per group, no float atomics, so every sum the last
program takes over the others' partials runs in a fixed order (deterministic: :func:`_summed`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _last_program(COUNTER, which, SPLITS):
    """Whether this program is the last of the SPLITS of its (batch·head, segment) to finish: its partials are
    stored; the barrier orders every thread's stores before the ticket, whose acquire-release makes the others'
    visible to the last (a ticket, not a float atomic: the sums stay in a fixed order). The last puts the ticket
    back to 0 (:func:`_ticket_back`), so the counters are zero between launches."""
    tl.debug_barrier()
    return tl.atomic_add(COUNTER + which, 1, sem="acq_rel") == SPLITS - 1


@triton.jit
def _ticket_back(COUNTER, which):
    tl.atomic_xchg(COUNTER + which, 0, sem="relaxed")


@triton.jit
def _summed(P, first, SPLITS, offset, width, idx, ok):
    """Σ over the SPLITS partials ``first``.. (rows of ``width`` floats) of the entries ``offset + idx``, in the
    partials' order (deterministic). ``.cg``: from L2, where the other programs' stores are, not a stale L1."""
    total = tl.zeros(idx.shape, dtype=tl.float32)
    for s in range(0, SPLITS):
        total += tl.load(P + (first + s) * width + offset + idx, mask=ok, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_partials(PART, out, width, square_part, row_part, d, d_ok, D):
    """A program's partial d×d square and d row as entries 0 and D·D of row ``out`` of PART (rows of ``width``)."""
    tl.store(PART + out * width + d[:, None] * D + d[None, :], square_part, mask=d_ok[:, None] & d_ok[None, :])
    tl.store(PART + out * width + D * D + d, row_part, mask=d_ok)


@triton.jit
def _partials_summed(PART, COUNTER, which, split, SPLITS, width, square_part, row_part, d, d_ok, D):
    """The last-program epilogue of the state kernel and the read-out's backward: this program's partial d×d square
    and d row stored as entries 0 and D·D of row ``which·SPLITS + split`` of PART (rows of ``width`` floats; the
    caller stores any others first), then the ticket (:func:`_last_program`): (last, Σ squares, Σ rows), summed in
    the partials' order by the last program only."""
    square = d[:, None] * D + d[None, :]
    square_ok = d_ok[:, None] & d_ok[None, :]
    _store_partials(PART, which * SPLITS + split, width, square_part, row_part, d, d_ok, D)
    last = _last_program(COUNTER, which, SPLITS)
    total, row = tl.zeros(square_part.shape, tl.float32), tl.zeros(row_part.shape, tl.float32)
    if last:
        total = _summed(PART, which * SPLITS, SPLITS, 0, width, square, square_ok)
        row = _summed(PART, which * SPLITS, SPLITS, D * D, width, d, d_ok)
    return last, total, row


@triton.jit
def _rows_total(ROWS, first, COUNT, width, OUT, BLOCK: tl.constexpr):
    """Σ of the COUNT rows ``first``.. of ROWS (``width`` floats each) in their order, into OUT in its dtype, BLOCK
    columns at a time."""
    idx = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        ok = start + idx < width
        total = _summed(ROWS, first, COUNT, start, width, idx, ok)
        tl.store(OUT + start + idx, total.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def batch_total(ROWS, COUNTER, b, B, PER, width, OUT, BLOCK: tl.constexpr):
    """A weight's gradient summed over the batch in the kernel, no torch op after it: once a program has stored its
    row of ROWS (image b's PER rows first, then B rows of scratch), the last of the image's PER (a ticket at
    COUNTER + b) sums them in order into scratch row B·PER + b, and the last image's (a ticket at COUNTER + B) those
    B rows in order into OUT (its dtype: the weight's). Two tickets deep, so no program sums more than PER or B rows
    (one program summing them all would be a serial tail of B·PER rows)."""
    if _last_program(COUNTER, b, PER):
        _rows_total(ROWS, b * PER, PER, width, ROWS + (B * PER + b) * width, BLOCK)
        _ticket_back(COUNTER, b)
        if _last_program(COUNTER, B, B):
            _rows_total(ROWS, B * PER, B, width, OUT, BLOCK)
            _ticket_back(COUNTER, B)
