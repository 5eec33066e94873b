"""How every fused op is called, whatever its folder: through the custom-op dispatcher where a tracer must see it,
else its direct ``autograd.Function`` or bare body (:func:`call_op`); its fake checked where a diagnostic asks
(:func:`fakes_checked`); and its eager gradients where a backward kernel cannot be built (:func:`_eager_gradients`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .dispatch import KernelUnavailable, current, direct, disable, kernels_on


def _direct_function(name: str, body, setup_context, backward) -> type[torch.autograd.Function]:
    """An op's eager calls without the custom-op dispatcher (:func:`.dispatch.direct`): the same body, the same
    saved tensors and the same backward (whose kernels also run direct when the gradient is a plain tensor).
    ``forward`` takes ``ctx`` itself: a Function with ``setup_context`` binds its arguments by ``inspect`` on
    every call, tens of µs."""
    def forward(ctx, *args):
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),  # no double backward, as the ops
                                                   "backward": staticmethod(once_differentiable(backward))})


def call_op(op, function: type[torch.autograd.Function], body, args: tuple, differentiable: tuple):
    """``op(*args)`` through the custom-op dispatcher where a tracer must see the op (:func:`.dispatch.direct` of q,
    the first argument); else the op's direct ``function``, or its bare ``body`` when autograd does not record the
    call (grad off, or none of the ``differentiable`` tensors requires grad: no Function, no ctx). Where a
    diagnostic asks (:func:`fakes_checked`), the op's fake runs on the same inputs too."""
    if not direct(args[0]):
        out = op(*args)
    else:
        records = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
        out = (function.apply if records else body)(*args)
    differ = current().fakes
    if differ is not None:
        _check_fake(op, args, out, differ)
    return out


def _check_fake(op, args: tuple, out, differ: list) -> None:
    """Appends (op, real, fake) (dtype, shape, strides of the dimensions above size 1) to ``differ`` where ``op``'s
    fake on ``args`` says other than ``out``."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # lazy: start-up time (a diagnostic's)
    from torch.utils._pytree import tree_leaves  # lazy: start-up time

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    for real, faked in zip(tree_leaves(out), tree_leaves(fake), strict=True):
        # (a dimension of size 1 may have any stride: only the others say where an element is)
        meta = [(t.dtype, tuple(t.shape), tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1))
                for t in (real, faked)]
        if meta[0] != meta[1]:
            differ.append((str(op), *meta))


@contextmanager
def fakes_checked() -> Iterator[list]:
    """Inside, each fused op called through :func:`call_op` (every variant's) also runs its fake on the same inputs
    (what torch.compile and torch.export take the op to return); yields the list of (op, real, fake) (dtype, shape,
    strides) that differ. A diagnostic for the GPU's paths (benchmarks/gpu_check.py's parity section, the tests):
    CUDA's autocast once made MHLA's op return float32 where its fake said bf16."""
    with kernels_on(fakes=[]) as dispatch:
        yield dispatch.fakes


def eager_gradients(form, inputs: tuple[Optional[torch.Tensor], ...], grads: tuple[torch.Tensor, ...],
                    *args) -> tuple[Optional[torch.Tensor], ...]:
    """d(form(*inputs, *args))/d(inputs) · grads by autograd over an op's eager form (None for None inputs and for
    the integer ones such as masks and index tables)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() if t is not None and t.is_floating_point() else t for t in inputs]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        outputs = form(*leaves, *args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
    found = iter(found)
    result = []
    for t in leaves:
        if t is not None and t.requires_grad:
            g = next(found)
            result.append(torch.zeros_like(t) if g is None else g)
        else:
            result.append(None)
    return tuple(result)


def _eager_gradients(error: KernelUnavailable, op: str, form, inputs, grads, *args):
    """A backward kernel that cannot be built here: ``op``'s kernels go off for the process (one warning) and
    this step's gradients come from the op's eager form (:func:`eager_gradients`)."""
    disable(error, op)
    return eager_gradients(form, inputs, grads, *args)
