"""TTT's step with its q/k convs on a module cast to bf16 (``model.to(torch.bfloat16)``): the convs' weights and
biases (and the fast weights) handed over as they are, read and their gradients stored in bf16 by the kernels (TTT's
and, on the split path, the grid op's), no torch op per call, with a padding mask too (each image's step lr·s/n
counted from its mask row in the kernels)."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.ops import dispatch
from vitconvert.attention.ops.ttt import op as fused_ttt

from . import helpers
from .fused_cases import (
    ALLOCATIONS,
    DEVICE,
    TOL,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    launches_and_ops,
    padding_mask,
)
from .helpers import rel_error

STEP_KERNELS = {"one program a head": ["ttt_bwd_kernel"],
                "split": ["swiglu_readout_bwd_kernel", "grid_conv_bwd_kernel"]}


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("path", list(STEP_KERNELS))
def test_ttt_reads_the_convs_of_a_bf16_cast_module_in_bf16_and_runs_no_torch_op(path, masked):
    """A TTT module cast to bf16 hands its q/k convs' weights and biases and its fast weights to the step as they
    are: the kernels read them in bf16 (float32 in registers) and store their gradients so, with one program a head
    (the whole backward in one kernel) and with heads split over token ranges (the convs' backward in the grid op's
    kernel), so no torch op but allocations and views runs in either pass (no cast of the filters per call); values
    and every gradient against the float64 eager step within the bf16 bars. With a padding mask (the images' valid
    keys differ) the same: each kernel counts its image's valid keys for the step lr·s/n (no torch op for it)."""
    from vitconvert.attention.ops.linear.launches import tickets

    grid, prefix, B, H, d = (6, 6), 2, 2, 2, 16
    N = prefix + grid[0] * grid[1]
    here = dispatch.current()
    here.ttt_dtypes = dispatch.DTYPES
    if path == "split":  # (as test_split_launches forces it: token ranges of 16)
        here.programs, here.split_round = 64, 16
        here.settings = dispatch.KernelSettings(config=(16, 4, 1))
    module = helpers.make_module("ttt", prefix, grid, dim=H * d, heads=H, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # (away from the init: the convs' biases not zero, the filters not the init's)
        for conv in (module.q_conv, module.k_conv):
            conv.weight.add_(0.3 * torch.randn(conv.weight.shape, generator=g))
            conv.bias.add_(0.1 * torch.randn(conv.bias.shape, generator=g))
    module = module.to(DEVICE, torch.bfloat16)
    params = (module.fast_w1, module.fast_w2, module.fast_w3, module.q_conv.weight, module.q_conv.bias,
              module.k_conv.weight, module.k_conv.bias)
    assert all(p.dtype == torch.bfloat16 for p in params)
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(3))
    mask = padding_mask(B, N) if masked else None
    w1, w2, w3, q_filter, q_bias, k_filter, k_bias = params
    scale, lr, eps = d ** -0.5, 0.7, module.key_norm_eps
    tickets(4096, q.device)  # (made before the recording: a first call's zeros are no op of the step)
    inputs = (q, k, v, *params)
    runs, out, grad, got = launches_and_ops(
        lambda: fused_ttt.call_step(q, k, v, mask, (w1, w2, w3), scale, lr, q_filter, q_bias, (*grid, prefix),
                                    k_filter, k_bias, eps), inputs)
    assert set(STEP_KERNELS[path]) <= set(runs["backward"]), runs["backward"]
    for run in runs.values():
        assert {e for e in run if not e.endswith("_kernel")} <= ALLOCATIONS | {"detach", "unbind"}, run  # (unbind:
        # dW's three views, the fast weights' gradients)
    copies = [t.detach().double().requires_grad_() for t in inputs]
    q, k, v, w1, w2, w3, q_filter, q_bias, k_filter, k_bias = copies
    expected = fused_ttt.ttt_eager(q, k, v, mask, (w1, w2, w3), scale, lr, q_filter, q_bias, *grid, prefix,
                                   k_filter, k_bias, eps)
    assert rel_error(out, expected) < TOL[torch.bfloat16]
    for name, mine, want in zip(["q", "k", "v", "W1", "W2", "W3", "q filter", "q bias", "k filter", "k bias"], got,
                                torch.autograd.grad(expected, copies, grad.double()), strict=True):
        assert mine.dtype == torch.bfloat16, name
        assert rel_error(mine, want) < 2 * TOL[torch.bfloat16], name
