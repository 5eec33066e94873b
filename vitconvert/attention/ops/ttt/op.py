"""TTT's closed-form step on the GPU: the Triton kernels of :mod:`.kernels` and :mod:`.backward_kernels` as one
PyTorch custom op.

``vitconvert::ttt_step``  (q, k, v, W1, W2, W3, w_q, b_q, w_k, b_k) -> (o, statistics, W')

W1, W2, W3: the (H, d, d) fast weights, read as the module holds them (no stacked copy). With the key conv's
filters w_k, b_k, k is the raw keys: their instance norm (its statistics, (2, B, H, d) float32, are the second
output, kept for backward; formed by the step kernel where a program owns a head, else a reading pass first) and
residual conv are applied as the kernels load each tile, so neither the normalised nor the convolved keys cross
memory; without them k is taken as it is. q likewise, convolved as it loads when w_q
is given. Where one program owns a head's tokens the inner sums, W' = W − lr·∇L and the read-out are one kernel
(W' stays in registers); where heads split over token ranges, the ranges' partial sums, which the last program of
each batch·head sums (a ticket: fixed order, no float atomics) into W', then the read-out: no torch op between.
Backward keeps q, k, v and the statistics, and W' ((B·H, 3, d, d), the third output) where heads split and the launch
plan keeps it (``LinearLaunches.keeps_summed``: where softmax keeps as much more; else the output is empty): where a
program owns a head, one kernel recomputes W' and runs the read-out's, the sums' and both convs' backward (from a
q-sized scratch), the last program of each head summing the gradients of W and the filters over the batch; else the
read-out's backward (on the kept W', or on W' formed again by the forward's sums kernel; its last programs summing dW'
over the ranges), the sums' (one kernel, or two on GPUs with 99 KB of shared memory a block, the last program of each
head summing dW over the images and ranges: :func:`_sums_backward`), then the convs' (ops/grid's kernel: q's, and k's
through its norm). Registered like the linear-attention ops: torch.compile and torch.export see one op, and a plain
eager call skips the dispatcher (:func:`.dispatch.direct`). A backward kernel Triton cannot build in any form turns
TTT's kernels off and takes that step's gradients from the op's eager form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from ..calls import _direct_function, _eager_gradients, call_op
from ..dispatch import KernelUnavailable, direct, fits, launch, tile_args, too_big
from ..grid.op import grid_conv_eager, run_grid_conv_backward, statistics
from ..launch_plan import LinearLaunches, kept_dtype, linear_launches
from ..layout import _mask_arg, _output_like, unit_rows
from .closed_form import stepped_readout

ONE_PASS = "ttt_step: the sums' backward in one kernel"  # (dispatch.fits: where it does not, two kernels)
ONE_PROGRAM = "ttt_step: a head's step in one program"  # (where it does not fit: partial sums, then the read-out)
ONE_KERNEL = "ttt_step: a head's backward in one kernel"  # (where it does not fit: the read-out's, then the sums')
PARTIAL_SQUARES = 3  # Ĝ1, Ĝ2, Ĝ3: the d×d float32 sums a token range writes (launch_plan.shortest_range weighs them)


def _step_size(key_valid: Optional[torch.Tensor], tokens: int, scale: float, lr: float) -> float:
    """The kernels' ``step``: lr·s/n, so that W' = W + (lr·s/n)·Ĝ (the step −lr times the inner loss's factor −s/n,
    n the valid keys); with a mask lr·s, each kernel dividing by its image's n, counted from the mask row (no torch
    op per call)."""
    return lr * scale / (tokens if key_valid is None else 1)


def _launches(q: torch.Tensor) -> LinearLaunches:
    """The kernel plan's launches of a call on ``q`` (ops/launch_plan.py; its sizes as plain numbers: a fake's
    symbolic ones are fixed to what the call has, as the plan is decided per shape bucket)."""
    B, H, N, _ = (int(n) for n in q.shape)
    return linear_launches(q, B * H, 1, N, False, True, PARTIAL_SQUARES)


def _geometry(q: torch.Tensor, plan: LinearLaunches) -> tuple[int, ...]:
    """B, H, N, d, the token ranges (count, length) and the block sizes (BLOCK_N, BLOCK_D, warps) of a launch."""
    return *q.shape, plan.splits, plan.per, plan.block_n, plan.block_d, plan.warps


def _kept_updated(q: torch.Tensor, plan: LinearLaunches) -> torch.Tensor:
    """The op's third output where the plan keeps W' for backward (``LinearLaunches.keeps_summed``, heads split):
    (B·H, 3, d, d) in the dtype the backward's tiles read it in (:func:`.launch_plan.kept_dtype`), for the split
    forward's sums kernel to write; else empty."""
    B, H, _, D = q.shape
    if not plan.keeps_summed:
        return q.new_empty((0,), dtype=torch.float32)
    return q.new_empty((B * H, 3, D, D), dtype=kept_dtype(q.dtype))


def _filters(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (H·d, 1, 3, 3) depthwise conv as the kernels read it: (H·d, 9) filters and bias in the module's dtype
    (views, no torch op: the kernels convert them to float32 as they load them), or placeholders."""
    filters = like if weight is None else weight.contiguous().view(weight.shape[0], -1)
    return filters, like if bias is None else bias.contiguous()


class _Step:
    """One call's launch arguments: the keys' side (k, v, mask, W, the key conv's filters and the statistics), the
    queries' (q, its conv's filters), the grid and the settings every TTT kernel takes."""

    def __init__(self, q, k, v, key_valid, weights: Sequence[torch.Tensor], scale, lr, q_filter, q_bias, k_filter,
                 k_bias, stats, rows, cols, prefix) -> None:
        self.q, self.k, self.v = q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
        self.plan = _launches(q)
        self.geometry = _geometry(q, self.plan)
        B, H, N, D, _, _, block_n, block_d, warps = self.geometry
        mask, s_mb = _mask_arg(key_valid, k)
        self.scalar = _step_size(key_valid, N, scale, lr)
        self.stats = stats if k_filter is not None else k  # (a placeholder: K_CONV off)
        self.keys = (k, v, mask, *(w.contiguous() for w in weights), *_filters(k_filter, k_bias, k), self.stats)
        self.key_strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_mb)
        self.queries = (q, *_filters(q_filter, q_bias, q))
        self.grid = (prefix, rows, cols)
        self.blocks = dict(HAS_MASK=key_valid is not None, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
        self.key_flags = dict(K_CONV=k_filter is not None, K_BIAS=k_bias is not None)
        self.q_flags = dict(CONV=q_filter is not None, HAS_BIAS=q_bias is not None)

    def one_program(self) -> bool:
        """Whether one program owns each head's tokens (:func:`_one_program`'s fused kernels apply)."""
        return self.geometry[4] == 1

    def updated(self, kept: Optional[torch.Tensor] = None) -> torch.Tensor:
        """W' = W + step·Ĝ (B·H, 3, d, d) float32, the read-out kernels' layout: the token ranges' partial sums of Ĝ
        summed, and W' formed, by the last program of each batch·head (no torch op between the launches), which
        also write it into ``kept`` where given (for backward, in its dtype)."""
        from ..linear.launches import tickets  # lazy: start-up time
        from .kernels import inner_sums_kernel  # lazy: start-up time (triton loads only when a kernel runs)

        B, H, N, D, splits, per, *_ = self.geometry
        G = self.k.new_empty((B * H, 3, splits, D, D), dtype=torch.float32)
        updated = self.k.new_empty((B * H, 3, D, D), dtype=torch.float32)
        launch(inner_sums_kernel, (B * H, splits), *self.keys, G, tickets(B * H, self.k.device), updated,
               updated if kept is None else kept, *self.key_strides, self.scalar, B, H, N, D, splits, per, *self.grid,
               **self.key_flags, KEEP=kept is not None, **self.blocks, **tile_args(self.k))
        return updated


def _one_program(form: str, fused_launch: Callable[[], None], otherwise: Callable[[], None], step: _Step) -> None:
    """``fused_launch`` where one program owns each head and ``form`` fits this GPU, else ``otherwise``: a fused
    kernel that fits no settings is not tried again (:func:`.dispatch.too_big`)."""
    if step.one_program() and fits(form):
        try:
            return fused_launch()
        except KernelUnavailable as e:
            if not e.resources:
                raise
            too_big(form, e)
    return otherwise()


def _key_gradient_strides(dk: torch.Tensor, dv: torch.Tensor) -> tuple[int, ...]:
    return dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2)


def run_ttt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor], w1: torch.Tensor,
            w2: torch.Tensor, w3: torch.Tensor, scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
            q_bias: Optional[torch.Tensor] = None, k_filter: Optional[torch.Tensor] = None,
            k_bias: Optional[torch.Tensor] = None, key_norm_eps: float = 1.0, rows: int = 0, cols: int = 0,
            prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, statistics, W'): out_i = f_{W'}(q_i) after one inner step on (k, v), for (B, H, N, d) q, k, v and (H,
    d, d) W1, W2, W3 (module docstring); the keys' statistics (empty without ``k_filter``) and W' (empty where the
    plan does not keep it: :func:`_kept_updated`) are for backward. The convs run on the rows × cols grid after
    ``prefix`` tokens."""
    from .kernels import swiglu_readout_kernel, ttt_fwd_kernel  # lazy: start-up time

    B, H, _, D = q.shape
    stats = k.new_empty((2, B, H, D) if k_filter is not None else (0,), dtype=torch.float32)
    step = _Step(q, k, v, key_valid, (w1, w2, w3), scale, lr, q_filter, q_bias, k_filter, k_bias, stats, rows, cols,
                 prefix)
    q = step.q
    B, H, N, D, splits, per, *_ = step.geometry
    o, kept = _output_like(q), _kept_updated(q, step.plan)
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    o_strides = (o.stride(0), o.stride(1), o.stride(2))

    def fused_launch() -> None:
        launch(ttt_fwd_kernel, (B * H,), *step.keys, *step.queries, o, *step.key_strides, step.scalar,
               *q_strides, *o_strides, key_norm_eps, B, H, N, D, *step.grid, **step.key_flags, **step.q_flags,
               **step.blocks, **tile_args(q))

    def split_launches() -> None:  # (the statistics first: a reading pass over the keys, its programs' sums)
        if k_filter is not None:
            statistics(step.k, key_valid, key_norm_eps, out=stats)
        updated = step.updated(kept if kept.numel() else None)
        launch(swiglu_readout_kernel, (B * H, splits), *step.queries, step.keys[2], updated, o, *q_strides,
               step.key_strides[-1], *o_strides, H, N, D, per, *step.grid, **step.q_flags, **step.blocks,
               **tile_args(q))

    _one_program(ONE_PROGRAM, fused_launch, split_launches, step)
    return o, stats, kept


ttt_step = torch.library.custom_op("vitconvert::ttt_step", mutates_args=())(run_ttt)


@ttt_step.register_fake
def _(q, k, v, key_valid, w1, w2, w3, scale, lr, q_filter=None, q_bias=None, k_filter=None, k_bias=None,
      key_norm_eps=1.0, rows=0, cols=0, prefix=0):
    B, H, _, D = q.shape
    stats = q.new_empty((2, B, H, D) if k_filter is not None else (0,), dtype=torch.float32)
    return _output_like(q), stats, _kept_updated(q, _launches(q))


def run_ttt_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                     key_valid: Optional[torch.Tensor], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     stats: torch.Tensor, updated: torch.Tensor, scale: float, lr: float,
                     q_filter: Optional[torch.Tensor] = None, q_bias: Optional[torch.Tensor] = None,
                     k_filter: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None, rows: int = 0,
                     cols: int = 0, prefix: int = 0) -> list[torch.Tensor]:
    """[dq, dk, dv, dW (3, H, d, d), dw_q, db_q, dw_k, db_k] of :func:`ttt_step` (the conv's empty where absent):
    W' (``updated``, the forward's where the plan kept it, else recomputed) and the read-out's backward (dq, dW'),
    the sums' (dĜ = step·dW': dk, dv and the chain's dW), dW = Σ_batch (dW' + the chain's) (in the one kernel, or by
    the sums' kernels' last programs from per-image parts), then the convs' backward."""
    from .backward_kernels import (  # lazy: start-up time
        part_width,
        swiglu_readout_bwd_kernel,
        ttt_bwd_kernel,
        ttt_readout_bwd_kernel,
    )

    step = _Step(q, k, v, key_valid, (w1, w2, w3), scale, lr, q_filter, q_bias, k_filter, k_bias, stats, rows, cols,
                 prefix)
    q, do = step.q, unit_rows(do)
    B, H, N, D, splits, per, *_ = step.geometry
    dq = _output_like(q)  # (tokens-major, as the forward's o: the convs' backward then reads a view of it, no copy)
    dk, dv = _output_like(step.k), _output_like(step.v)
    strides = (q.stride(0), q.stride(1), q.stride(2), do.stride(0), do.stride(1), do.stride(2), dq.stride(0),
               dq.stride(1), dq.stride(2))
    tiles = tile_args(q, half_tiles=True)
    d_updated = q.new_empty((B * H, 3, D, D), dtype=torch.float32)  # dW' (the split path's or one program's)
    dweights = q.new_empty((3, H, D, D), dtype=w1.dtype)  # dW1, dW2, dW3 (summed by the kernels' last programs)
    convs = [f for f in (q_filter, k_filter) if f is not None]
    d_filters = None  # the convs' gradients where the one kernel gives them

    def whole() -> None:  # (with a conv, its backward too: a scratch of q's size, the filters' rows per program)
        nonlocal d_filters
        from ..linear.launches import tickets  # lazy: start-up time

        scratch = _output_like(q) if convs else dq  # (a placeholder without: unread)
        filters = [q.new_empty(shape, dtype=f.dtype) if f is not None else dweights  # (q's filters, bias, then k's,
                   for f in (q_filter, k_filter) for shape in ((H * D, 9), (H * D,))]  # in the weight's dtype)
        part, counter = dweights, dq.new_empty((1,), dtype=torch.int32)  # (one image: placeholders, unread)
        if B > 1:
            part = q.new_empty((B, part_width(H, D, len(convs))), dtype=torch.float32)
            counter = tickets(H, q.device)[:H]  # (a head's ticket each)
        launch(ttt_bwd_kernel, (B * H,), *step.keys, *step.queries, do, dq, dk, dv, dweights, scratch,
               *filters, part, counter, *step.key_strides, step.scalar, *strides,
               *_key_gradient_strides(dk, dv), *scratch.stride()[:3], part.stride(0), B, H, N, D, *step.grid,
               **step.key_flags, **step.q_flags, **step.blocks, **tiles)
        d_filters = filters if convs else None

    def fused_launch() -> None:
        launch(ttt_readout_bwd_kernel, (B * H,), *step.keys, *step.queries, do, dq, d_updated,
               *step.key_strides, step.scalar, *strides, B, H, N, D, *step.grid, **step.key_flags, **step.q_flags,
               **step.blocks, **tiles)

    def split_launches() -> None:  # (dW' summed over the ranges by the last program of each batch·head)
        from ..linear.launches import tickets  # lazy: start-up time

        partials = q.new_empty((B * H, 3, splits, D, D), dtype=torch.float32)
        kept = updated if updated.numel() else step.updated()  # (W' again only where the forward did not keep it)
        launch(swiglu_readout_bwd_kernel, (B * H, splits), *step.queries, step.keys[2], kept, do, dq,
               partials, tickets(B * H, q.device), d_updated, *strides[:3], step.key_strides[-1], *strides[3:], H, N,
               D, splits, per, *step.grid, **step.q_flags, **step.blocks, **tiles)

    def in_parts() -> None:  # the read-out's backward, then the sums' from dW' in memory, dW summed in their kernels
        _one_program(ONE_PROGRAM, fused_launch, split_launches, step)
        _sums_backward(step, d_updated, dk, dv, dweights)

    _one_program(ONE_KERNEL, whole, in_parts, step)
    grads = [dq, dk, dv, dweights, *(q.new_empty((0,)) for _ in range(4))]  # (outputs of their own)
    for at, t, filters, bias, norm in ((0, q, q_filter, q_bias, False), (1, k, k_filter, k_bias, True)):
        if filters is not None and d_filters is not None:
            d_filter, d_bias = d_filters[2 * at:2 * at + 2]
            grads[4 + 2 * at] = d_filter.view(filters.shape)
            if bias is not None:
                grads[5 + 2 * at] = d_bias.to(bias.dtype)  # (no op where it is the weight's, as a module's is)
        elif filters is not None:
            try:
                grads[at], d_filter, d_bias = run_grid_conv_backward(t, filters, key_valid, stats, grads[at], rows,
                                                                     cols, prefix, norm)
            except KernelUnavailable as e:
                e.op = "grid_conv"  # (the grid op's kernel: that op goes off, the step keeps its kernels)
                raise
            grads[4 + 2 * at] = d_filter  # (in the weight's dtype: the kernel stores it so)
            if bias is not None:
                grads[5 + 2 * at] = d_bias.to(bias.dtype)
    return grads


def _sums_backward(step: _Step, d_updated: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                   dweights: torch.Tensor) -> None:
    """dk, dv and dW (3, H, d, d) = Σ_batch (dW' + the inner sums' chain) from dW' (B·H, 3, d, d), their gradient
    dĜ = step·dW' formed as the kernels load it, dW summed over the images and token ranges by the last program of
    each head (its parts (3, H·B·splits, d, d), dW' in each image's first range's): one kernel, or where its
    twelve d×d operands do not fit the GPU's shared memory (an L40 or RTX 4090 gives a block 99 KB, it needs 106
    at its leanest; benchmarks/kernel_resources.py --arch sm_89), a kernel for dk and dW1, dW2 and one for dv and
    dW3 (ten and seven operands), each recomputing the forward's token-sized values."""
    from ..linear.launches import tickets  # lazy: start-up time
    from .backward_kernels import (  # lazy: start-up time
        inner_sums_bwd_kernel,
        inner_sums_bwd_keys_kernel,
        inner_sums_bwd_values_kernel,
    )

    B, H, N, D, splits, per, *_ = step.geometry
    parts = dk.new_empty((3, H * B * splits, D, D), dtype=torch.float32)

    def run(kernel, gradient_k: torch.Tensor, gradient_v: torch.Tensor) -> None:
        launch(kernel, (B * H, splits), *step.keys, d_updated, gradient_k, gradient_v, parts,
               tickets(H, dk.device), dweights, *step.key_strides, step.scalar, *_key_gradient_strides(dk, dv), B, H,
               N, D, splits, per, *step.grid, **step.key_flags, **step.blocks, **tile_args(step.k, half_tiles=True))

    if fits(ONE_PASS):
        try:
            return run(inner_sums_bwd_kernel, dk, dv)
        except KernelUnavailable as e:
            if not e.resources:
                raise
            too_big(ONE_PASS, e)
    run(inner_sums_bwd_keys_kernel, dk, dk)  # (each kernel's other gradient: a placeholder, unread)
    run(inner_sums_bwd_values_kernel, dv, dv)


ttt_step_backward = torch.library.custom_op("vitconvert::ttt_step_backward", mutates_args=())(run_ttt_backward)


@ttt_step_backward.register_fake
def _(q, k, v, do, key_valid, w1, w2, w3, stats, updated, scale, lr, q_filter=None, q_bias=None, k_filter=None,
      k_bias=None, rows=0, cols=0, prefix=0):
    conv = [q.new_empty((0,)) if t is None else torch.empty_like(t) for t in (q_filter, q_bias, k_filter, k_bias)]
    return [*(_output_like(t) for t in (q, k, v)), w1.new_empty((3, *w1.shape)), *conv]


def _setup(ctx, inputs, output) -> None:
    q, k, v, key_valid, w1, w2, w3, scale, lr, q_filter, q_bias, k_filter, k_bias, eps, rows, cols, prefix = inputs
    ctx.save_for_backward(q, k, v, key_valid, w1, w2, w3, output[1], output[2], q_filter, q_bias, k_filter, k_bias)
    ctx.args = (scale, lr)
    ctx.grid = (rows, cols, prefix)
    ctx.eps = eps
    ctx.set_materialize_grads(False)  # the statistics and W' get no gradient: no zero tensors for them


def _backward(ctx, do, _, __):  # (the statistics and W' are for backward only: nothing flows back through them)
    if do is None:
        return (None,) * 17
    q, k, v, key_valid, w1, w2, w3, stats, updated, q_filter, q_bias, k_filter, k_bias = ctx.saved_tensors
    convs = (q_filter, q_bias, k_filter, k_bias)
    try:
        dq, dk, dv, dweights, *d_convs = (run_ttt_backward if direct(do) else ttt_step_backward)(
            q, k, v, do, key_valid, w1, w2, w3, stats, updated, *ctx.args, *convs, *ctx.grid)
        dw1, dw2, dw3 = dweights.unbind(0)
    except KernelUnavailable as e:
        inputs = (q, k, v, key_valid, w1, w2, w3, *convs)
        dq, dk, dv, _, dw1, dw2, dw3, *d_convs = _eager_gradients(e, getattr(e, "op", "ttt_step"),
                                                                  _ttt_eager_inputs_first, inputs, (do,), *ctx.args,
                                                                  ctx.eps, *ctx.grid)
    d_convs = [None if t is None else g for t, g in zip(convs, d_convs, strict=True)]
    return (dq, dk, dv, None, dw1, dw2, dw3, None, None, *d_convs, None, None, None, None)


ttt_step.register_autograd(_backward, setup_context=_setup)
_DirectStep = _direct_function("DirectTTTStep", run_ttt, _setup, _backward)


def _ttt_eager_inputs_first(q, k, v, key_valid, w1, w2, w3, q_filter, q_bias, k_filter, k_bias, scale, lr, eps, rows,
                            cols, prefix):
    return ttt_eager(q, k, v, key_valid, (w1, w2, w3), scale, lr, q_filter, q_bias, rows, cols, prefix, k_filter,
                     k_bias, eps)


def ttt_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
              weights: Sequence[torch.Tensor], scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
              q_bias: Optional[torch.Tensor] = None, rows: int = 0, cols: int = 0, prefix: int = 0,
              k_filter: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None,
              key_norm_eps: float = 1.0) -> torch.Tensor:
    """:func:`ttt_step`'s output in torch, float32 (its backward's fallback and the tests' oracle of the op);
    ``weights``: W1, W2, W3 (a (3, H, d, d) tensor unpacks to them)."""
    if q_filter is not None:
        q = grid_conv_eager(q, None, q_filter, q_bias, key_valid, rows, cols, prefix)
    if k_filter is not None:
        k = grid_conv_eager(k, None, k_filter, k_bias, key_valid, rows, cols, prefix, key_norm_eps)
    w1, w2, w3 = weights
    dtype, acc = q.dtype, torch.promote_types(w1.dtype, torch.float32)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    return stepped_readout(q, k, v, key_valid, w1.to(acc), w2.to(acc), w3.to(acc), scale, lr).to(dtype)


def call_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: Optional[torch.Tensor],
              weights: Sequence[torch.Tensor], scale: float, lr: float, q_filter: Optional[torch.Tensor] = None,
              q_bias: Optional[torch.Tensor] = None, grid: tuple[int, int, int] = (0, 0, 0),
              k_filter: Optional[torch.Tensor] = None, k_bias: Optional[torch.Tensor] = None,
              key_norm_eps: float = 1.0) -> torch.Tensor:
    """The op's output, called direct where it may (:func:`..calls.call_op`); ``weights``: W1, W2, W3 (a (3, H, d,
    d) tensor unpacks to them); ``grid`` (rows, cols, prefix tokens) of the convs where ``q_filter`` or
    ``k_filter`` is given (``k_filter``: k is the raw keys, normalised and convolved in the op)."""
    w1, w2, w3 = weights
    args = (q, k, v, key_valid, w1, w2, w3, scale, lr, q_filter, q_bias, k_filter, k_bias, key_norm_eps, *grid)
    return call_op(ttt_step, _DirectStep, run_ttt, args, (q, k, v, w1, w2, w3, q_filter, q_bias, k_filter,
                                                          k_bias))[0]
