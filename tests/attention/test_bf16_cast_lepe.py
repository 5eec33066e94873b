"""MHLA's fused ops (the pairwise and blocked forms) on a module cast to bf16 (``model.to(torch.bfloat16)``): its
parameters handed over as they are, read and their gradients stored in bf16 by the kernels, no torch op per call."""

from __future__ import annotations

import pytest
import torch

from vitconvert.attention.blocks import segment_index, token_segments
from vitconvert.attention.ops.linear import op as fused
from vitconvert.attention.ops.pairwise import op as fused_pairwise
from vitconvert.attention.ops.pairwise.reference import pairwise_reference

from . import helpers
from .fused_cases import (
    ALLOCATIONS,
    DEVICE,
    TOL,
    explicit_lepe,
    kernels_here,  # noqa: F401  (an autouse fixture: the kernels on this device)
    launches_and_ops,
    padding_mask,
)
from .helpers import rel_error

EPS = 1e-6


@pytest.mark.parametrize("form", ["pairwise", "blocked"])
def test_either_form_reads_lepe_of_a_bf16_cast_module_in_bf16_and_runs_no_torch_op(form):
    """An MHLA module cast to bf16 (``model.to(torch.bfloat16)``: W, the norm weights and LePE's weight and bias in
    bf16) hands its parameters to either form's op as they are: the kernels read LePE's filters and bias in bf16
    and store their gradients so, so no torch op but allocations and views runs either way (no cast of LePE per
    call); values and every gradient against the float64 reference within the bf16 bars."""
    from vitconvert.attention.ops.linear.launches import tickets

    grid, counts, prefix, B, H, d = (6, 7), (2, 2), 1, 2, 2, 16
    N = prefix + grid[0] * grid[1]
    module = helpers.make_module("mhla", prefix, grid, dim=H * d, heads=H, dtype=torch.float32, blocks_per_side=2,
                                 lepe_kernel=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # (away from the init: W not symmetric, norm weights and the bias not constant)
        for param in (module.block_mix, module.q_rmsnorm.weight, module.k_rmsnorm.weight, module.lepe.bias):
            param.add_(torch.rand(param.shape, generator=g))
    module = module.to(DEVICE, torch.bfloat16)
    params = (module.block_mix, module.lepe.weight, module.lepe.bias, module.q_rmsnorm.weight,
              module.k_rmsnorm.weight)
    assert all(p.dtype == torch.bfloat16 for p in params)
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(DEVICE, torch.bfloat16).requires_grad_() for _ in range(3))
    mask = padding_mask(B, N)
    mixing, weight, bias, *norms = params
    op, table = {"pairwise": (fused_pairwise.pairwise, token_segments),
                 "blocked": (fused.segmented_attention, segment_index)}[form]
    segments = table(grid, counts, prefix, q.device)
    tickets(4096, q.device)  # (made before the recording: a first call's zeros are no op of the step)
    inputs = (q, k, v, *params)
    runs, out, grad, got = launches_and_ops(
        lambda: op(q, k, v, mask, segments, mixing, fused.RELU_PLUS_EPS, EPS, EPS, *norms, 1e-6, weight, bias, grid,
                   prefix), inputs)
    assert ("pairwise_fwd_kernel" in runs["forward"]) is (form == "pairwise")
    for run in runs.values():
        assert {e for e in run if not e.endswith("_kernel")} <= ALLOCATIONS | {"detach"}, run
    copies = [t.detach().double().requires_grad_() for t in inputs]
    q, k, v, mixing, weight, bias, q_weight, k_weight = copies
    q, k = (x * torch.rsqrt(x.square().mean(dim=(1, 3), keepdim=True) + 1e-6) * w.view(1, H, 1, d)
            for x, w in ((q, q_weight), (k, k_weight)))
    expected = (pairwise_reference(torch.relu(q) + EPS, torch.relu(k) + EPS, v, mask,
                                   token_segments(grid, counts, prefix, q.device), mixing, EPS)
                + explicit_lepe(v, weight, bias, mask, grid, prefix))
    assert rel_error(out, expected) < TOL[torch.bfloat16]
    for name, mine, want in zip(["q", "k", "v", "W", "LePE weight", "LePE bias", "q norm", "k norm"], got,
                                torch.autograd.grad(expected, copies, grad.double()), strict=True):
        assert mine.dtype == torch.bfloat16, name
        assert rel_error(mine, want) < 2 * TOL[torch.bfloat16], name
