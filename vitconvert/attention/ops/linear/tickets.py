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
